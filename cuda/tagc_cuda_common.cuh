/*
 * tagc_cuda_common.cuh - helpers private to the cuda/ launchers: dtype
 * loads/stores through tagc_portable.h, launch checking, workspace carving,
 * block scans and the tile-offset scan kernel shared by the compactions.
 * Everything here is static (each .cu file gets its own copy).
 */
#ifndef TAGC_CUDA_COMMON_CUH
#define TAGC_CUDA_COMMON_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#include "tagc_cuda.h"
#include "../csrc/tagc_portable.h"

#define TAGC_THREADS 256
/* Elements per tile of the compactions: 16 chunks of TAGC_THREADS. */
#define TAGC_TILE_CHUNKS 16
#define TAGC_TILE (TAGC_THREADS * TAGC_TILE_CHUNKS)
/* Grid-stride kernels use at most this many blocks: enough to fill any
 * current GPU, few enough that per-block merges stay cheap. */
#define TAGC_MAX_BLOCKS 1024
#define TAGC_WS_ALIGN 256
#define TAGC_FULL_MASK 0xffffffffu
/* "No residual" marker, as in the C codec. */
#define TAGC_DT_NONE (-1)

/* Return TAGC_ERR_CUDA when a runtime call or the last launch failed. */
#define TAGC_CUDA_TRY(call)                                                  \
    do {                                                                     \
        if ((call) != cudaSuccess)                                           \
            return TAGC_ERR_CUDA;                                            \
    } while (0)
#define TAGC_CUDA_LAUNCHED() TAGC_CUDA_TRY(cudaGetLastError())

static __host__ __device__ __forceinline__ int64_t tagc_ceil_div(int64_t a,
                                                                 int64_t b)
{
    return (a + b - 1) / b;
}

/* Blocks for a grid-stride loop over `work` items of `per_block` each. */
static inline unsigned tagc_grid(int64_t work, int64_t per_block)
{
    int64_t g = tagc_ceil_div(work, per_block);
    if (g < 1)
        g = 1;
    return (unsigned)(g > TAGC_MAX_BLOCKS ? TAGC_MAX_BLOCKS : g);
}

/* Workspace layout: the same carve() calls size the workspace (base NULL)
 * and hand out its pieces, so the size query and the launcher cannot
 * disagree. */
typedef struct {
    uint8_t *base;
    size_t off;
} tagc_carver;

static inline void *tagc_carve(tagc_carver *c, size_t bytes)
{
    size_t o = (c->off + TAGC_WS_ALIGN - 1) & ~(size_t)(TAGC_WS_ALIGN - 1);
    c->off = o + bytes;
    return c->base != NULL ? c->base + o : NULL;
}

/* Bytes a layout needs once the caller's pointer has been aligned. */
static inline size_t tagc_carved_size(const tagc_carver *c)
{
    return c->off + TAGC_WS_ALIGN;
}

/* Points c at the caller's workspace, aligned, if it holds `need` bytes. */
static inline tagc_status tagc_ws_open(tagc_carver *c, void *ws, size_t ws_bytes,
                                       size_t need)
{
    if (ws == NULL)
        return TAGC_ERR_ARG;
    if (ws_bytes < need)
        return TAGC_ERR_CAPACITY;
    uintptr_t p = ((uintptr_t)ws + TAGC_WS_ALIGN - 1) &
                  ~(uintptr_t)(TAGC_WS_ALIGN - 1);
    c->base = (uint8_t *)p;
    c->off = 0;
    return TAGC_OK;
}

/* The first min(len, 8) bytes at p as a little-endian word (none when len <= 0):
 * received messages come at any alignment and are read a byte at a time (the
 * twin of load_le in csrc/tagc_internal.h). */
static __device__ __forceinline__ uint64_t tagc_ld_le(const uint8_t *p, int64_t len)
{
    uint64_t w = 0;
    for (int i = 0; i < 8 && i < len; i++)
        w |= (uint64_t)p[i] << (8 * i);
    return w;
}

/* A record's fp32 scale, stored and loaded byte by byte (little-endian):
 * records of a message start at any byte. */
static __device__ __forceinline__ void tagc_st_scale(uint8_t *p, float s)
{
    uint32_t u = __float_as_uint(s);
    for (int b = 0; b < 4; b++)
        p[b] = (uint8_t)(u >> (8 * b));
}

static __device__ __forceinline__ float tagc_ld_scale(const uint8_t *p)
{
    return __uint_as_float((uint32_t)tagc_ld_le(p, 4));
}

static __device__ __forceinline__ float tagc_ld(const void *p, int d, int64_t i)
{
    if (d == TAGC_F32)
        return ((const float *)p)[i];
    return tagc_bf16_to_f32(((const uint16_t *)p)[i]);
}

static __device__ __forceinline__ void tagc_st(void *p, int d, int64_t i, float v)
{
    if (d == TAGC_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = tagc_f32_to_bf16(v);
}

/* What a value becomes once stored in dtype d and read back. */
static __device__ __forceinline__ float tagc_round_to(int d, float v)
{
    return d == TAGC_F32 ? v : tagc_bf16_to_f32(tagc_f32_to_bf16(v));
}

/* v = grad (+ residual): the error-feedback sum, in fp32 as the C codec. */
typedef struct {
    const void *g;
    const void *r;
    int gd;
    int rd; /* TAGC_DT_NONE: no residual */
} tagc_gr;

static __device__ __forceinline__ float tagc_gr_load(tagc_gr s, int64_t i)
{
    float v = tagc_ld(s.g, s.gd, i);
    if (s.rd != TAGC_DT_NONE)
        v += tagc_ld(s.r, s.rd, i);
    return v;
}

/* A block's quant scale from each lane's partial statistics (acc: its double
 * sum of |v|, m: its max |v|): the shuffle tree csrc/quant.c's block_scale
 * mirrors, then tagc_q_scale.  Every lane returns it. */
static __device__ __forceinline__ float tagc_warp_q_scale(double acc, float m, int format,
                                                          int64_t len)
{
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_down_sync(TAGC_FULL_MASK, acc, off);
        float other = __shfl_down_sync(TAGC_FULL_MASK, m, off);
        m = other > m ? other : m;
    }
    acc = __shfl_sync(TAGC_FULL_MASK, acc, 0);
    m = __shfl_sync(TAGC_FULL_MASK, m, 0);
    return tagc_q_scale(format, acc, m, len);
}

/* The magnitude as its 31-bit pattern: ordered like |v| for finite v. */
static __device__ __forceinline__ uint32_t tagc_mag_key(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}

/* First data error wins; 0 means none. */
static __device__ __forceinline__ void tagc_dev_fail(int32_t *st, int32_t code)
{
    if (st != NULL)
        atomicCAS((int *)st, 0, (int)code);
}

/* Inclusive sum of x over the block (blockDim.x a multiple of 32, <= 1024);
 * every thread must call it.  sh: 32 words of shared memory. */
static __device__ __forceinline__ uint32_t tagc_block_incl_scan(uint32_t x,
                                                                uint32_t *sh,
                                                                uint32_t *total)
{
    unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned nwarps = blockDim.x >> 5;
    for (unsigned o = 1; o < 32; o <<= 1) {
        uint32_t y = __shfl_up_sync(TAGC_FULL_MASK, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        uint32_t w = lane < nwarps ? sh[lane] : 0;
        for (unsigned o = 1; o < 32; o <<= 1) {
            uint32_t y = __shfl_up_sync(TAGC_FULL_MASK, w, o);
            if (lane >= o)
                w += y;
        }
        sh[lane] = w;
    }
    __syncthreads();
    if (warp > 0)
        x += sh[warp - 1];
    *total = sh[nwarps - 1];
    __syncthreads(); /* sh may be reused by the caller's next scan */
    return x;
}

/* For one chunk of consecutive positions (one per thread, in thread order):
 * the number of flagged threads before this one in the block, the block's
 * total, and this warp's ballot (bit l = lane l flagged).  Every thread must
 * call it.  sh: 32 words of shared memory. */
static __device__ __forceinline__ uint32_t tagc_block_flag_prefix(int flag,
                                                                  uint32_t *sh,
                                                                  uint32_t *total,
                                                                  uint32_t *ballot)
{
    unsigned lane = threadIdx.x & 31u;
    uint32_t m = __ballot_sync(TAGC_FULL_MASK, flag);
    uint32_t warp_count = lane == 0 ? (uint32_t)__popc(m) : 0u;
    /* Scan of one value per warp (on lane 0, zero elsewhere). */
    uint32_t incl = tagc_block_incl_scan(warp_count, sh, total);
    uint32_t warp_before = __shfl_sync(TAGC_FULL_MASK, incl - warp_count, 0);
    *ballot = m;
    return warp_before + (uint32_t)__popc(m & ((1u << lane) - 1u));
}

/* Exclusive scan of per-tile counts in one block: off[i] = sum of cnt[0..i),
 * *total (optional) = the sum of all.  ntiles is bounded by 2^31 / TAGC_TILE,
 * so one block looping over 1024-tile chunks is cheap next to the data pass
 * that produced the counts. */
static __global__ void tagc_tile_scan_kernel(uint32_t *off, const uint32_t *cnt,
                                             int64_t ntiles, uint32_t *total)
{
    __shared__ uint32_t sh[32];
    uint32_t carry = 0;
    for (int64_t base = 0; base < ntiles; base += blockDim.x) {
        int64_t i = base + threadIdx.x;
        uint32_t c = i < ntiles ? cnt[i] : 0u, chunk;
        uint32_t incl = tagc_block_incl_scan(c, sh, &chunk);
        if (i < ntiles)
            off[i] = carry + incl - c;
        carry += chunk;
    }
    if (total != NULL && threadIdx.x == 0)
        *total = carry;
}

static inline tagc_status tagc_tile_scan(uint32_t *off, const uint32_t *cnt,
                                         int64_t ntiles, uint32_t *total,
                                         cudaStream_t stream)
{
    tagc_tile_scan_kernel<<<1, 1024, 0, stream>>>(off, cnt, ntiles, total);
    TAGC_CUDA_LAUNCHED();
    return TAGC_OK;
}

/* Stores one byte of a bitmap word built from a warp ballot, skipping bytes
 * at or past nbytes (the tail of the bitmap belongs to nobody). */
static __device__ __forceinline__ void tagc_store_ballot(uint8_t *bitmap,
                                                         int64_t byte0,
                                                         int64_t nbytes,
                                                         uint32_t ballot)
{
    unsigned lane = threadIdx.x & 31u;
    if (lane < 4 && byte0 + lane < nbytes)
        bitmap[byte0 + lane] = (uint8_t)(ballot >> (8 * lane));
}

#endif /* TAGC_CUDA_COMMON_CUH */
