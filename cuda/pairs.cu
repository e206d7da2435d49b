/*
 * pairs.cu - tagc_cuda_pairs_pack / tagc_cuda_pairs_unpack_add: coded pairs
 * (Elias-Fano, bitmap, dense; csrc/tagc.h) with the bytes and sums of
 * csrc/pairs.c.
 *
 * A message is a slice of an all-to-all buffer, so it starts at any byte:
 * everything in it is read and written a byte at a time, and each byte has
 * one writer (no atomics on words that may reach past the slice).
 *
 * Pack: one thread per pair checks its position, copies its value and, when
 * it is the first pair whose bit falls in a byte of the bitmap or upper
 * bitvector, writes that byte (the pairs of one byte are consecutive, at
 * most 8); EF low bits are gathered one output byte per thread.
 *
 * Unpack: the positions are the set bits of a bit array (the bitmap, or the
 * EF upper vector, where bit b of rank j is high part b - j), and the value
 * of a set bit is the one at its rank.  So: popcount per tile of 32-bit
 * words, an exclusive scan over tiles, then each tile's block rescans its
 * words and every thread walks its word's set bits knowing their ranks.  The
 * first walk only validates (EF), a second adds; a device flag between them
 * keeps a corrupt message out of `out`.
 */
#include "tagc_cuda_common.cuh"
#include "../csrc/tagc_checks.h"

/* ---- byte-wise access ------------------------------------------------- */

/* Word w (bytes 4w..4w+3, little-endian) of an nbytes-long bit array; bytes
 * past the end read as 0. */
static __device__ __forceinline__ uint32_t pairs_word(const uint8_t *p, int64_t nbytes,
                                                      int64_t w)
{
    return (uint32_t)tagc_ld_le(p + 4 * w, nbytes - 4 * w < 4 ? nbytes - 4 * w : 4);
}

/* The l-bit field at bit offset `at` of an LSB-first bit array of nbytes
 * (l <= 30: at most 5 bytes). */
static __device__ __forceinline__ uint32_t pairs_field(const uint8_t *p, int64_t nbytes,
                                                       int64_t at, int l)
{
    int64_t b0 = at >> 3;
    uint64_t x = tagc_ld_le(p + b0, nbytes - b0 < 5 ? nbytes - b0 : 5);
    return (uint32_t)((x >> (at & 7)) & (((uint64_t)1 << l) - 1));
}

static __device__ __forceinline__ float pairs_ld_val(const uint8_t *p, int vs, int64_t j)
{
    uint32_t u = (uint32_t)tagc_ld_le(p + j * vs, vs);
    return vs == 4 ? __uint_as_float(u) : tagc_bf16_to_f32((uint16_t)u);
}

/* ---- pack --------------------------------------------------------------- */

/* Where a message's parts lie, from (n, k, dtype, coding) alone. */
typedef struct {
    int coding;
    int l;            /* EF low bits */
    int vs;           /* bytes per value */
    int64_t n, k;
    int64_t lo_bytes; /* EF low bits: ceil(k*l/8) */
    int64_t bits_off; /* the bitmap / upper vector */
    int64_t bits;     /* its length in bits: n, or k + ((n-1) >> l) + 1 */
    int64_t vals_off; /* the k values (BITMAP, EF) */
} pairs_msg;

static pairs_msg pairs_msg_of(int64_t n, int64_t k, tagc_dtype vd, tagc_coding coding)
{
    pairs_msg m;
    m.coding = (int)coding;
    m.l = coding == TAGC_PAIRS_EF ? tagc_check_ef_low_bits(n, k) : 0;
    m.vs = (int)tagc_check_dtype_size((int)vd);
    m.n = n;
    m.k = k;
    m.lo_bytes = (k * m.l + 7) >> 3;
    m.bits_off = m.lo_bytes;
    m.bits = coding == TAGC_PAIRS_EF ? k + ((n - 1) >> m.l) + 1 : n;
    m.vals_off = m.bits_off + ((m.bits + 7) >> 3);
    return m;
}

/* Bit of pair j in the bitmap / upper vector, or -1 for a position outside
 * [0, n) (it must not address a byte: dst bytes are then unspecified, but
 * never outside dst). */
static __device__ __forceinline__ int64_t pairs_bit(const int32_t *idx, pairs_msg m,
                                                    int64_t j)
{
    int64_t p = idx[j];
    if (p < 0 || p >= m.n)
        return -1;
    return m.coding == TAGC_PAIRS_EF ? (p >> m.l) + j : p;
}

/* Thread i: pair i (if i < k) and EF low-bit byte i (if i < lo_bytes).  The
 * bit array was zeroed before (bytes holding no bit keep 0). */
static __global__ void pairs_pack_kernel(uint8_t *dst, const int32_t *idx, const void *val,
                                         pairs_msg m, int32_t *dev_status)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t work = m.k > m.lo_bytes ? m.k : m.lo_bytes;
    int bad = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < work; i += stride) {
        if (i < m.k) {
            int64_t p = idx[i];
            bad |= p < 0 || p >= m.n || (i > 0 && p <= idx[i - 1]);
            uint32_t bits = m.vs == 4 ? ((const uint32_t *)val)[i]
                                      : ((const uint16_t *)val)[i];
            /* DENSE: value at its position (none for a bad one), else at
             * its rank. */
            int64_t at = m.coding != TAGC_PAIRS_DENSE ? m.vals_off + i * m.vs
                         : p >= 0 && p < m.n          ? p * m.vs
                                                      : -1;
            for (int b = 0; at >= 0 && b < m.vs; b++)
                dst[at + b] = (uint8_t)(bits >> (8 * b));
            int64_t bit = m.coding == TAGC_PAIRS_DENSE ? -1 : pairs_bit(idx, m, i);
            /* The first pair of its byte writes the byte: ascending bits
             * put a byte's pairs next to each other, 8 at most. */
            if (bit >= 0 && (i == 0 || pairs_bit(idx, m, i - 1) >> 3 != bit >> 3)) {
                unsigned byte = 0;
                for (int64_t j = i; j < m.k && j < i + 8; j++) {
                    int64_t b = pairs_bit(idx, m, j);
                    if (b < 0 || b >> 3 != bit >> 3)
                        break;
                    byte |= 1u << (b & 7);
                }
                if ((bit >> 3) < ((m.bits + 7) >> 3))
                    dst[m.bits_off + (bit >> 3)] = (uint8_t)byte;
            }
        }
        if (i < m.lo_bytes) {
            /* Fields j overlapping bits [8i, 8i + 8) of the low part. */
            uint64_t byte = 0, mask = ((uint64_t)1 << m.l) - 1;
            int64_t last = (8 * i + 7) / m.l;
            for (int64_t j = 8 * i / m.l; j <= last && j < m.k; j++) {
                uint64_t low = (uint64_t)(uint32_t)idx[j] & mask;
                int64_t s = j * m.l - 8 * i;
                byte |= s >= 0 ? low << s : low >> -s;
            }
            dst[i] = (uint8_t)byte;
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        tagc_dev_fail(dev_status, TAGC_ERR_RANGE);
}

extern "C" size_t tagc_cuda_pairs_pack_workspace_size(void)
{
    return 0; /* nothing to carve: see tagc_cuda.h */
}

extern "C" tagc_status tagc_cuda_pairs_pack(uint8_t *dst, int64_t dst_capacity,
                                            const int32_t *idx, const void *val,
                                            tagc_dtype val_dtype, int64_t k, int64_t n,
                                            tagc_coding coding, int32_t *dev_status,
                                            void *workspace, size_t workspace_bytes,
                                            cudaStream_t stream)
{
    (void)workspace;
    (void)workspace_bytes;
    tagc_status s = tagc_check_pairs_pack(dst, dst_capacity, idx, val, (int)val_dtype, k, n,
                                          (int)coding);
    if (s != TAGC_OK || k == 0)
        return s;
    pairs_msg m = pairs_msg_of(n, k, val_dtype, coding);
    if (coding == TAGC_PAIRS_DENSE)
        TAGC_CUDA_TRY(cudaMemsetAsync(dst, 0, (size_t)(n * m.vs), stream));
    else
        TAGC_CUDA_TRY(cudaMemsetAsync(dst + m.bits_off, 0, (size_t)((m.bits + 7) >> 3),
                                      stream));
    int64_t work = k > m.lo_bytes ? k : m.lo_bytes;
    pairs_pack_kernel<<<tagc_grid(work, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
        dst, idx, val, m, dev_status);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

/* ---- unpack ------------------------------------------------------------- */

/* A tile of the rank scan is one word of 32 bits per thread of a block:
 * small, so that a message of a typical shard (10^5..10^7 bits) still
 * spreads over many blocks; the one-block tile scan then loops over at most
 * 2^32 / 8192 tiles (a 2^31 shard with k > n/2), 512 rounds. */
#define PAIRS_TILE_BITS ((int64_t)TAGC_THREADS * 32)

typedef struct {
    /* Set bits of the whole bit array, padding included: 64 bits, so that a
     * corrupt upper vector of ~2^32 ones cannot wrap around to k. */
    unsigned long long ones;
    int32_t bad;
} pairs_flags;

typedef struct {
    pairs_flags *flags;
    uint32_t *tile_cnt, *tile_off;
} pairs_ws;

static int64_t pairs_tiles(int64_t bits)
{
    return tagc_ceil_div(bits > 0 ? bits : 1, PAIRS_TILE_BITS);
}

/* The workspace must serve any coding of (n, k): tiles for the longer of
 * the bitmap (n bits) and the EF upper vector. */
static size_t pairs_ws_layout(tagc_carver *c, int64_t n, int64_t k, pairs_ws *w)
{
    int l = tagc_check_ef_low_bits(n, k);
    int64_t bits = n > 0 ? n : 0;
    if (l >= 0 && n > 0 && k + ((n - 1) >> l) + 1 > bits)
        bits = k + ((n - 1) >> l) + 1;
    size_t tiles = (size_t)pairs_tiles(bits);
    w->flags = (pairs_flags *)tagc_carve(c, sizeof(pairs_flags));
    w->tile_cnt = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    w->tile_off = (uint32_t *)tagc_carve(c, tiles * sizeof(uint32_t));
    return tagc_carved_size(c);
}

/* Set bits per tile of the bit array at src + bits_off, and (one atomic
 * per block) their total. */
static __global__ void pairs_count_kernel(uint32_t *tile_cnt, pairs_flags *flags,
                                          const uint8_t *src, pairs_msg m, int64_t ntiles)
{
    __shared__ uint32_t sh[32];
    const uint8_t *bits = src + m.bits_off;
    int64_t nbytes = (m.bits + 7) >> 3, nwords = (nbytes + 3) >> 2;
    unsigned long long ones = 0;
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int64_t w = tile * TAGC_THREADS + threadIdx.x;
        uint32_t x = w < nwords ? (uint32_t)__popc(pairs_word(bits, nbytes, w)) : 0u, total;
        (void)tagc_block_incl_scan(x, sh, &total);
        if (threadIdx.x == 0)
            tile_cnt[tile] = total;
        ones += total;
    }
    if (threadIdx.x == 0 && ones != 0)
        atomicAdd(&flags->ones, ones);
}

/* Walks the set bits of the bit array with their ranks.  add == 0: the
 * validation of csrc/pairs.c -- block 0 checks the count and the padding
 * bits, and for EF every position is decoded and checked (< n, above the
 * previous one); any failure sets the flag and CORRUPT in dev_status.
 * add == 1: out[p_j] += value_j, skipped entirely once the flag is set. */
static __global__ void pairs_walk_kernel(float *out, const uint8_t *src, pairs_msg m,
                                         const uint32_t *tile_off, int64_t ntiles,
                                         pairs_flags *flags, int32_t *dev_status, int add)
{
    __shared__ uint32_t sh[32];
    /* One read of the flag for the whole block: other blocks of a check
     * walk may set it meanwhile, and the scans below need every thread. */
    if (__syncthreads_or(threadIdx.x == 0 && flags->bad != 0))
        return;
    const uint8_t *bits = src + m.bits_off, *vals = src + m.vals_off;
    int64_t nbytes = (m.bits + 7) >> 3, nwords = (nbytes + 3) >> 2;
    int ef = m.coding == TAGC_PAIRS_EF, found = 0;
    if (!add && blockIdx.x == 0 && threadIdx.x == 0) {
        found |= flags->ones != (unsigned long long)m.k;
        if (m.bits & 7)
            found |= (bits[nbytes - 1] >> (m.bits & 7)) != 0;
        if (ef && ((m.k * m.l) & 7))
            found |= (src[m.lo_bytes - 1] >> ((m.k * m.l) & 7)) != 0;
    }
    /* A bitmap's positions need no check beyond the count and padding. */
    for (int64_t tile = blockIdx.x; tile < ntiles && (add || ef); tile += gridDim.x) {
        int64_t w = tile * TAGC_THREADS + threadIdx.x;
        uint32_t word = w < nwords ? pairs_word(bits, nbytes, w) : 0u, total;
        uint32_t x = (uint32_t)__popc(word);
        int64_t j = tile_off[tile] + tagc_block_incl_scan(x, sh, &total) - x;
        /* Bit below the current one: set means the previous position has
         * the same EF high part, so its low part must be smaller. */
        int below = w > 0 && w < nwords && (bits[4 * w - 1] >> 7) != 0;
        uint32_t prev_low = 0;
        int have_prev = 0;
        for (uint32_t left = word; left != 0; left &= left - 1, j++) {
            int i = __ffs((int)left) - 1;
            int64_t b = 32 * w + i;
            int adjacent = i > 0 ? (int)((word >> (i - 1)) & 1u) : below;
            if (j >= m.k || b >= m.bits) {
                found = 1; /* more than k ones or padding set: flagged */
                break;
            }
            int64_t p = b;
            if (ef) {
                if (b < j) {
                    found = 1; /* ranks off: the count was wrong */
                    break;
                }
                uint32_t low = m.l > 0 ? pairs_field(src, m.lo_bytes, j * m.l, m.l) : 0u;
                p = ((b - j) << m.l) | low;
                if (!add && adjacent) {
                    if (!have_prev)
                        prev_low = m.l > 0 ? pairs_field(src, m.lo_bytes, (j - 1) * m.l, m.l)
                                           : 0u;
                    found |= low <= prev_low;
                }
                found |= p >= m.n;
                prev_low = low;
                have_prev = 1;
            }
            if (add)
                out[p] = __fadd_rn(out[p], pairs_ld_val(vals, m.vs, j));
        }
    }
    if (!add && __syncthreads_or(found) && threadIdx.x == 0) {
        flags->bad = 1;
        tagc_dev_fail(dev_status, TAGC_ERR_CORRUPT);
    }
}

/* DENSE: n values, no validation. */
static __global__ void pairs_dense_add_kernel(float *out, const uint8_t *src, int64_t n,
                                              int vs)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __fadd_rn(out[i], pairs_ld_val(src, vs, i));
}

extern "C" size_t tagc_cuda_pairs_unpack_add_workspace_size(int64_t n, int64_t k)
{
    tagc_carver c = {NULL, 0};
    pairs_ws w;
    return pairs_ws_layout(&c, n, k, &w);
}

extern "C" tagc_status tagc_cuda_pairs_unpack_add(float *out, int64_t n,
                                                  const uint8_t *src, int64_t src_bytes,
                                                  int64_t k, tagc_dtype val_dtype,
                                                  tagc_coding coding, int32_t *dev_status,
                                                  void *workspace, size_t workspace_bytes,
                                                  cudaStream_t stream)
{
    tagc_status s = tagc_check_pairs_unpack(out, n, src, src_bytes, k, (int)val_dtype,
                                            (int)coding);
    if (s != TAGC_OK)
        return s;
    tagc_carver c;
    s = tagc_ws_open(&c, workspace, workspace_bytes,
                     tagc_cuda_pairs_unpack_add_workspace_size(n, k));
    if (s != TAGC_OK || k == 0)
        return s;
    pairs_msg m = pairs_msg_of(n, k, val_dtype, coding);
    if (coding == TAGC_PAIRS_DENSE) {
        pairs_dense_add_kernel<<<tagc_grid(n, TAGC_THREADS), TAGC_THREADS, 0, stream>>>(
            out, src, n, m.vs);
        TAGC_CUDA_LAUNCHED();
        return TAGC_OK;
    }
    pairs_ws w;
    pairs_ws_layout(&c, n, k, &w);
    int64_t ntiles = pairs_tiles(m.bits);
    unsigned grid = tagc_grid(ntiles, 1);
    TAGC_CUDA_TRY(cudaMemsetAsync(w.flags, 0, sizeof *w.flags, stream));
    pairs_count_kernel<<<grid, TAGC_THREADS, 0, stream>>>(w.tile_cnt, w.flags, src, m,
                                                          ntiles);
    TAGC_CUDA_LAUNCHED();
    s = tagc_tile_scan(w.tile_off, w.tile_cnt, ntiles, NULL, stream);
    if (s != TAGC_OK)
        return s;
    /* A bitmap's check is block 0's count and padding test alone. */
    unsigned check_grid = coding == TAGC_PAIRS_EF ? grid : 1u;
    pairs_walk_kernel<<<check_grid, TAGC_THREADS, 0, stream>>>(out, src, m, w.tile_off,
                                                               ntiles, w.flags, dev_status,
                                                               0);
    TAGC_CUDA_LAUNCHED();
    pairs_walk_kernel<<<grid, TAGC_THREADS, 0, stream>>>(out, src, m, w.tile_off, ntiles,
                                                         w.flags, dev_status, 1);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}
