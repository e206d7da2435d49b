/*
 * cuda/emu/cuda_runtime.h - a CPU emulation of the slice of the CUDA
 * execution model that the cuda/ kernels use, so that the kernels' logic can
 * RUN on a machine without a GPU (tests/test_cuda_emulated.py).  It stands in
 * for the real <cuda_runtime.h> when the .cu files are compiled by g++ after
 * cuda/emu/translate.py has rewritten each `k<<<g, b, s, st>>>(args)` into
 * `tagc_emu_launch(g, b, s, st, [=] { k(args); })`.
 *
 * Model: the blocks of a launch run one after another; the threads of a
 * block are fibers (ucontext) switched at barriers for __syncthreads and its
 * _count/_or forms; warp intrinsics (ballot, shuffles) exchange through
 * per-warp slots between two warp barriers; atomics are GCC __atomic
 * builtins; __shared__ variables are function statics (one block at a time
 * owns them); device memory is host memory.  What this does NOT model:
 * concurrent blocks (inter-block races), independent thread scheduling
 * inside a warp, the GPU memory model, occupancy, speed.  Passing here
 * checks logic, not a GPU.
 */
#ifndef TAGC_CUDA_EMU_RUNTIME_H
#define TAGC_CUDA_EMU_RUNTIME_H

#ifndef __cplusplus
#error "the CUDA emulation needs C++ (it is used by the emulated .cu build only)"
#endif

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

typedef void *cudaStream_t;
typedef enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 } cudaError_t;

struct tagc_emu_dim3 {
    unsigned x, y, z;
};

/* inline (C++17): one instance shared by every translation unit. */
inline tagc_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
inline cudaError_t tagc_emu_last = cudaSuccess;
/* What a launcher asked of the runtime since the library was loaded: kernel
 * launches and memsets (tagc_emu_counters; the host-cost proxy of
 * scripts/bench/tagc_bench/host_counts.py reads them around each call). */
inline long long tagc_emu_launches = 0, tagc_emu_memsets = 0;

/* `used`: emitted (as one merged weak symbol) although no kernel calls it. */
extern "C" __attribute__((used, visibility("default"))) inline void
tagc_emu_counters(long long *out)
{
    out[0] = tagc_emu_launches;
    out[1] = tagc_emu_memsets;
}

static inline cudaError_t cudaGetLastError(void)
{
    cudaError_t e = tagc_emu_last;
    tagc_emu_last = cudaSuccess;
    return e;
}

static inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s)
{
    (void)s;
    tagc_emu_memsets++;
    memset(p, v, n);
    return cudaSuccess;
}

/* A block's threads are fibers on the calling OS thread, run round-robin:
 * each runs until it reaches a barrier or returns, and a barrier releases its
 * waiters once every member has arrived.  Cheap and deterministic; a barrier
 * not reached by every thread is reported as a deadlock (it would hang or be
 * undefined on a GPU).  A fiber's stack is set up by makecontext and entered
 * once by setcontext; every later switch is _setjmp/_longjmp, which keep the
 * signal mask alone: swapcontext's sigprocmask system call at each of the
 * thousands of switches of a launch was a third of the emulated tests' time.
 * (The build undefines _FORTIFY_SOURCE: its longjmp check refuses a jump to
 * another stack.) */
enum { TAGC_EMU_RUN, TAGC_EMU_BLOCK_WAIT, TAGC_EMU_WARP_WAIT, TAGC_EMU_DONE };

struct tagc_emu_fiber {
    ucontext_t ctx; /* the first entry */
    jmp_buf jb;     /* where it yielded */
    int started;
    int state;
    uint64_t wait_gen;
};

struct tagc_emu_block {
    std::vector<tagc_emu_fiber> fib;
    unsigned arrived = 0;
    uint64_t gen = 0;
    std::vector<unsigned> warp_arrived;
    std::vector<uint64_t> warp_gen;
    std::vector<int> flag;     /* one per thread (__syncthreads_*) */
    int result = 0;            /* __syncthreads_* result */
    std::vector<uint64_t> xch; /* one slot per thread (warp exchange) */
    unsigned cur = 0;
    const std::function<void()> *body = nullptr;
    jmp_buf sched;
};
inline tagc_emu_block *tagc_emu_cur;
inline std::vector<char *> tagc_emu_stacks; /* reused, never freed */
#define TAGC_EMU_STACK (256 * 1024)

static inline void tagc_emu_fiber_main(void)
{
    tagc_emu_block *st = tagc_emu_cur;
    (*st->body)();
    st->fib[st->cur].state = TAGC_EMU_DONE;
    _longjmp(st->sched, 1); /* never returns: the stack is reused */
}

static inline void tagc_emu_yield(int state, uint64_t gen)
{
    tagc_emu_block *st = tagc_emu_cur;
    tagc_emu_fiber &f = st->fib[st->cur];
    f.state = state;
    f.wait_gen = gen;
    if (!_setjmp(f.jb))
        _longjmp(st->sched, 1);
}

/* Runs fiber f until it yields or ends.  A function of its own: the jump back
 * lands in this frame, whose variables do not change after the _setjmp. */
__attribute__((noinline)) static void tagc_emu_enter(tagc_emu_block *st, tagc_emu_fiber &f)
{
    if (!_setjmp(st->sched)) {
        if (!f.started) {
            f.started = 1;
            setcontext(&f.ctx);
        }
        _longjmp(f.jb, 1);
    }
}

static inline void tagc_emu_run_block(tagc_emu_block *st, unsigned nthreads)
{
    while (tagc_emu_stacks.size() < nthreads)
        tagc_emu_stacks.push_back((char *)malloc(TAGC_EMU_STACK));
    st->fib.resize(nthreads);
    ucontext_t proto;
    getcontext(&proto);
    for (unsigned i = 0; i < nthreads; i++) {
        tagc_emu_fiber &f = st->fib[i];
        f.ctx = proto;
        f.ctx.uc_stack.ss_sp = tagc_emu_stacks[i];
        f.ctx.uc_stack.ss_size = TAGC_EMU_STACK;
        f.ctx.uc_link = NULL;
        makecontext(&f.ctx, tagc_emu_fiber_main, 0);
        f.started = 0;
        f.state = TAGC_EMU_RUN;
    }
    unsigned left = nthreads;
    while (left > 0) {
        int ran = 0;
        for (unsigned i = 0; i < nthreads; i++) {
            tagc_emu_fiber &f = st->fib[i];
            if (f.state == TAGC_EMU_DONE ||
                (f.state == TAGC_EMU_BLOCK_WAIT && f.wait_gen == st->gen) ||
                (f.state == TAGC_EMU_WARP_WAIT && f.wait_gen == st->warp_gen[i / 32]))
                continue;
            st->cur = i;
            threadIdx = {i, 0, 0};
            f.state = TAGC_EMU_RUN;
            tagc_emu_enter(st, f);
            ran = 1;
            if (f.state == TAGC_EMU_DONE)
                left--;
        }
        if (!ran) {
            fprintf(stderr, "cuda emu: deadlock: a barrier not reached by every thread "
                            "(block %u)\n", blockIdx.x);
            abort();
        }
    }
}

static inline void tagc_emu_launch(unsigned grid, unsigned block, size_t smem,
                                   cudaStream_t stream, std::function<void()> body)
{
    (void)smem;
    (void)stream;
    tagc_emu_launches++;
    if (grid == 0 || block == 0 || block > 1024 || block % 32 != 0) {
        tagc_emu_last = cudaErrorInvalidValue;
        return;
    }
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        tagc_emu_block st;
        st.warp_arrived.assign(block / 32, 0);
        st.warp_gen.assign(block / 32, 0);
        st.flag.assign(block, 0);
        st.xch.assign(block, 0);
        st.body = &body;
        tagc_emu_cur = &st;
        blockIdx = {b, 0, 0};
        tagc_emu_run_block(&st, block);
    }
    tagc_emu_cur = NULL;
}

static inline void __syncthreads(void)
{
    tagc_emu_block *st = tagc_emu_cur;
    if (++st->arrived == blockDim.x) {
        st->arrived = 0;
        st->gen++; /* releases every waiter; the last one goes on */
        return;
    }
    tagc_emu_yield(TAGC_EMU_BLOCK_WAIT, st->gen);
}

/* Every thread posts its predicate; thread 0 folds them between two
 * barriers; all read the result before anyone can post the next one. */
static inline int tagc_emu_sync_fold(int pred, int count)
{
    tagc_emu_block *st = tagc_emu_cur;
    st->flag[threadIdx.x] = pred != 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = 0;
        for (int f : st->flag)
            r += f;
        st->result = count ? r : (r != 0);
    }
    __syncthreads();
    int r = st->result;
    __syncthreads();
    return r;
}

static inline int __syncthreads_count(int pred) { return tagc_emu_sync_fold(pred, 1); }
static inline int __syncthreads_or(int pred) { return tagc_emu_sync_fold(pred, 0); }

static inline void tagc_emu_warp_sync(void)
{
    tagc_emu_block *st = tagc_emu_cur;
    unsigned w = threadIdx.x / 32;
    if (++st->warp_arrived[w] == 32) {
        st->warp_arrived[w] = 0;
        st->warp_gen[w]++;
        return;
    }
    tagc_emu_yield(TAGC_EMU_WARP_WAIT, st->warp_gen[w]);
}

/* Posts v for the warp, returns what lane `src` posted. */
static inline uint64_t tagc_emu_exchange(uint64_t v, unsigned src)
{
    tagc_emu_block *st = tagc_emu_cur;
    unsigned base = threadIdx.x / 32 * 32;
    st->xch[threadIdx.x] = v;
    tagc_emu_warp_sync();
    uint64_t r = st->xch[base + src];
    tagc_emu_warp_sync();
    return r;
}

static inline unsigned __ballot_sync(unsigned mask, int pred)
{
    (void)mask;
    tagc_emu_block *st = tagc_emu_cur;
    unsigned base = threadIdx.x / 32 * 32;
    st->xch[threadIdx.x] = pred != 0;
    tagc_emu_warp_sync();
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++)
        r |= (unsigned)st->xch[base + l] << l;
    tagc_emu_warp_sync();
    return r;
}

static inline unsigned __shfl_up_sync(unsigned mask, unsigned v, unsigned d)
{
    (void)mask;
    unsigned lane = threadIdx.x % 32;
    unsigned r = (unsigned)tagc_emu_exchange(v, lane >= d ? lane - d : lane);
    return r;
}

static inline unsigned __shfl_down_sync(unsigned mask, unsigned v, unsigned d)
{
    (void)mask;
    unsigned lane = threadIdx.x % 32;
    return (unsigned)tagc_emu_exchange(v, lane + d < 32 ? lane + d : lane);
}

static inline unsigned __shfl_sync(unsigned mask, unsigned v, int src)
{
    (void)mask;
    return (unsigned)tagc_emu_exchange(v, (unsigned)src % 32);
}

/* Shuffles of float/double values move their bit patterns. */
static inline double __shfl_down_sync(unsigned mask, double v, unsigned d)
{
    (void)mask;
    unsigned lane = threadIdx.x % 32;
    uint64_t u, r;
    memcpy(&u, &v, sizeof u);
    r = tagc_emu_exchange(u, lane + d < 32 ? lane + d : lane);
    memcpy(&v, &r, sizeof v);
    return v;
}

static inline double __shfl_sync(unsigned mask, double v, int src)
{
    (void)mask;
    uint64_t u, r;
    memcpy(&u, &v, sizeof u);
    r = tagc_emu_exchange(u, (unsigned)src % 32);
    memcpy(&v, &r, sizeof v);
    return v;
}

static inline float __shfl_down_sync(unsigned mask, float v, unsigned d)
{
    return (float)__shfl_down_sync(mask, (double)v, d);
}

static inline float __shfl_sync(unsigned mask, float v, int src)
{
    return (float)__shfl_sync(mask, (double)v, src);
}

static inline int __all_sync(unsigned mask, int pred)
{
    return __ballot_sync(mask, pred) == 0xffffffffu;
}

static inline void __syncwarp(void) { tagc_emu_warp_sync(); }

/* Round-to-nearest float arithmetic: what the host computes anyway. */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }

/* Blocks run one after another: a fence orders nothing more than program
 * order already does, but the compiler must not move memory accesses
 * across it. */
static inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* CUDA's 16-byte vector type (vector_types.h), for the kernels' wide loads */
struct alignas(16) float4 {
    float x, y, z, w;
};

static inline float4 make_float4(float x, float y, float z, float w)
{
    return float4{x, y, z, w};
}

static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }

static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline unsigned atomicAdd(unsigned *p, unsigned v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

static inline float atomicAdd(float *p, float v)
{
    float old, want;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
        want = old + v;
    } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
    return old;
}

static inline unsigned atomicSub(unsigned *p, unsigned v)
{
    return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED);
}

static inline int atomicCAS(int *p, int cmp, int v)
{
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}

#endif /* TAGC_CUDA_EMU_RUNTIME_H */
