"""The CUDA kernels' own code, run on the CPU, against the C codec.

No GPU here, so ``cuda/emu/`` emulates the part of the CUDA execution model
the kernels use (blocks one after another, a block's threads as real threads
meeting at barriers, warp ballots/shuffles, atomics; see
``cuda/emu/cuda_runtime.h``).  ``cuda/emu/translate.py`` rewrites the
``<<<...>>>`` launches, g++ compiles every ``cuda/*.cu`` unchanged otherwise
into a shared library, and each launcher is compared with the C op of
``_tagc`` on identical inputs.  This checks the kernels' logic (radix
select, tie-breaking compaction, tile scans, bitmaps, peeling rounds, the
device-side error reporting) on every CPU run; it says nothing about GPU
speed, occupancy or the GPU memory model, which only tests/test_cuda_ops.py
on a GPU can check.  Sizes are small because every emulated thread is an OS
thread.
"""
from __future__ import annotations

import ctypes as C
import math
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = [pytest.mark.codec, pytest.mark.slow]
from cuda_helpers import (SPARSIFY_DTYPES, bitmap_of, gradient, kept, same_bits,
                          two_rank_sketch)
from tagc_bench import cuda_emu
from tagc_bench.cuda_emu import DT, F32, P, ws

ERR_RANGE, ERR_CAPACITY, ERR_NONFINITE, ERR_CORRUPT = 2, 3, 5, 6
I64, VP, INT = C.c_int64, C.c_void_p, C.c_int
QFORMAT = cuda_emu.QFORMAT


@pytest.fixture(scope="module")
def lib(cuda_emu_library: Path) -> C.CDLL:
    """The launchers compiled by g++ against the emulation (conftest's build)."""
    return cuda_emu.load(cuda_emu_library)


SIZES = [(1, 1), (9, 4), (300, 0), (300, 300), (4096, 40), (9000, 113)]


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_select_kth(lib: C.CDLL, n: int, k: int, dtype: torch.dtype, ties: bool) -> None:
    x = gradient(n, dtype, ties, seed=n + k)
    tau = torch.full((1,), -1.0)
    w = ws(lib.tagc_cuda_select_kth_workspace_size(n))
    assert lib.tagc_cuda_select_kth(P(tau), P(x), DT[dtype], n, k, P(w), w.numel(), None) == 0
    assert same_bits(tau, torch.tensor([_tagc.select_kth(x, k)], dtype=torch.float32))


def flat(n: int, seed: int) -> torch.Tensor:
    """Mostly +-1 with a few larger values: the k-th magnitude's digit bin holds
    almost every entry, more than the select's candidate buffer (n/16, at
    least 4096), so its third pass must fall back to reading the input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[torch.randperm(n, generator=g)[:n // 50]] *= 3.0
    return x


@pytest.mark.parametrize("n,k", [(9000, 500), (9000, 180), (70_000, 5000)])
def test_select_and_sparsify_when_candidates_overflow(lib: C.CDLL, n: int, k: int) -> None:
    x = flat(n, seed=k)
    tau = torch.zeros(1)
    w = ws(lib.tagc_cuda_select_kth_workspace_size(n))
    assert lib.tagc_cuda_select_kth(P(tau), P(x), F32, n, k, P(w), w.numel(), None) == 0
    assert same_bits(tau, torch.tensor([_tagc.select_kth(x, k)], dtype=torch.float32))
    r = flat(n, seed=k + 1) / 1024
    c_idx, c_val = torch.empty(k, dtype=torch.int32), torch.empty(k)
    c_bm, c_res = torch.empty((n + 7) // 8, dtype=torch.uint8), r.clone()
    want = _tagc.sparsify(c_idx, c_val, c_bm, c_res, x, k)
    res = r.clone()
    idx, val, bm, tau = run_sparsify(lib, x, res, k, torch.float32)
    assert same_bits(tau, torch.tensor([want], dtype=torch.float32))
    assert torch.equal(idx[:k], c_idx) and same_bits(val[:k], c_val)
    assert torch.equal(bm[:(n + 7) // 8], c_bm) and same_bits(res, c_res)


def test_select_kth_nonfinite_is_nan(lib: C.CDLL) -> None:
    x = gradient(5000, torch.float32, False, seed=2)
    x[1234] = float("-inf")
    tau = torch.zeros(1)
    w = ws(lib.tagc_cuda_select_kth_workspace_size(5000))
    assert lib.tagc_cuda_select_kth(P(tau), P(x), F32, 5000, 7, P(w), w.numel(), None) == 0
    assert math.isnan(float(tau))


def run_sparsify(lib: C.CDLL, g: torch.Tensor, r: Optional[torch.Tensor], k: int,
                 vd: torch.dtype):
    n = g.numel()
    idx = torch.full((k + 2,), -7, dtype=torch.int32)
    val = torch.full((k + 2,), 9.0, dtype=vd)
    bm = torch.full(((n + 7) // 8 + 2,), 0xA5, dtype=torch.uint8)
    tau = torch.zeros(1)
    w = ws(lib.tagc_cuda_sparsify_workspace_size(n))
    rd = DT[r.dtype] if r is not None else F32
    st = lib.tagc_cuda_sparsify(P(idx), k, P(val), DT[vd], k, P(bm), (n + 7) // 8, P(r), rd,
                                P(g), DT[g.dtype], n, k, P(tau), P(w), w.numel(), None)
    assert st == 0
    return idx, val, bm, tau


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("gd,rd,vd", SPARSIFY_DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_sparsify(lib: C.CDLL, n: int, k: int, gd: torch.dtype, rd: Optional[torch.dtype],
                  vd: torch.dtype, ties: bool) -> None:
    g = gradient(n, gd, ties, seed=3 * n + k)
    r = None if rd is None else (gradient(n, torch.float32, ties, seed=n) / 8).to(rd)
    c_idx = torch.full((k + 2,), -7, dtype=torch.int32)
    c_val = torch.full((k + 2,), 9.0, dtype=vd)
    c_bm = torch.full(((n + 7) // 8 + 2,), 0xA5, dtype=torch.uint8)
    c_res = None if r is None else r.clone()
    want = _tagc.sparsify(c_idx[:k], c_val[:k], c_bm[:(n + 7) // 8], c_res, g, k)
    e_res = None if r is None else r.clone()
    idx, val, bm, tau = run_sparsify(lib, g, e_res, k, vd)
    assert same_bits(tau, torch.tensor([want], dtype=torch.float32))
    assert torch.equal(idx, c_idx)
    assert same_bits(val, c_val)
    assert torch.equal(bm, c_bm)
    if r is not None:
        assert same_bits(e_res, c_res)


def test_sparsify_nonfinite(lib: C.CDLL) -> None:
    n, k = 6000, 30
    g = gradient(n, torch.float32, False, seed=8)
    g[4999] = float("nan")
    r = gradient(n, torch.float32, False, seed=9) / 8
    res = r.clone()
    idx, val, bm, tau = run_sparsify(lib, g, res, k, torch.float32)
    assert math.isnan(float(tau))
    assert same_bits(res, r)
    assert torch.equal(idx[:k], torch.arange(k, dtype=torch.int32))
    assert torch.isnan(val[:k]).all()
    want = torch.zeros(n, dtype=torch.bool)
    want[:k] = True
    assert torch.equal(bm[:(n + 7) // 8], bitmap_of(want))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 13, 5000])
def test_lanes_and_bitmaps(lib: C.CDLL, bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(n * bits)
    bms = [bitmap_of(torch.rand(n, generator=g) < 0.3) for _ in range(3)]
    nl = (n * bits + 7) // 8
    lanes = []
    for b in bms:
        c_l = torch.zeros(nl + 1, dtype=torch.uint8)
        e_l = torch.zeros(nl + 1, dtype=torch.uint8)
        _tagc.lanes_pack(c_l, b, n, bits)
        assert lib.tagc_cuda_lanes_pack(P(e_l), nl, P(b), n, bits, None) == 0
        assert torch.equal(e_l, c_l)
        lanes.append(c_l[:nl])
    summed = (sum(x.long() for x in lanes) % 256).to(torch.uint8)
    c_bm = torch.full(((n + 7) // 8 + 1,), 0x5A, dtype=torch.uint8)
    e_bm = c_bm.clone()
    _tagc.lanes_unpack(c_bm, summed, n, bits)
    assert lib.tagc_cuda_lanes_unpack(P(e_bm), e_bm.numel(), P(summed), nl, n, bits, None) == 0
    assert torch.equal(e_bm, c_bm)

    nb = (n + 7) // 8
    src = torch.cat(bms)
    c_or = torch.full((nb + 1,), 0x33, dtype=torch.uint8)
    e_or = c_or.clone()
    _tagc.bitmap_or(c_or, src, 3)
    assert lib.tagc_cuda_bitmap_or(P(e_or), nb, P(src), nb, 3, None) == 0
    assert torch.equal(e_or, c_or)

    cnt = torch.full((1,), -1, dtype=torch.int64)
    raw = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)  # tail bits set too
    assert lib.tagc_cuda_popcount(P(cnt), P(raw), n, None) == 0
    assert int(cnt) == _tagc.popcount(raw, n)


def encode(lib: C.CDLL, sd: torch.dtype, idx: torch.Tensor, val: torch.Tensor, n: int,
           t: int, seed: int, status: Optional[torch.Tensor] = None) -> torch.Tensor:
    sk = torch.full((3 * t + 1,), 5.0, dtype=sd)
    w = ws(lib.tagc_cuda_sketch_encode_workspace_size(t, DT[sd]))
    st = lib.tagc_cuda_sketch_encode(P(sk), DT[sd], 3 * t, P(idx), P(val), DT[val.dtype],
                                     idx.numel(), n, t, seed, P(status), P(w), w.numel(), None)
    assert st == 0
    return sk


@pytest.mark.parametrize("sd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
def test_sketch_encode(lib: C.CDLL, sd: torch.dtype, vd: torch.dtype) -> None:
    n, k, t = 20_000, 700, 300
    idx, val = kept(n, k, vd, seed=4)
    seed = _tagc.seed_derive(7, 3, 11)
    c_sk = torch.full((3 * t + 1,), 5.0, dtype=sd)
    _tagc.sketch_encode(c_sk[:3 * t], idx, val, n, t, seed)
    e_sk = encode(lib, sd, idx, val, n, t, seed)
    assert same_bits(e_sk[3 * t:], c_sk[3 * t:])
    tol = dict(rtol=1e-5, atol=1e-5) if sd == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(e_sk[:3 * t].float(), c_sk[:3 * t].float(), **tol)


def test_sketch_encode_bad_index_sets_range(lib: C.CDLL) -> None:
    idx = torch.tensor([1, 5, 99], dtype=torch.int32)
    status = torch.zeros(1, dtype=torch.int32)
    encode(lib, torch.float32, idx, torch.ones(3), 50, 10, 1, status)
    assert int(status) == ERR_RANGE


def assert_peel_close(got: torch.Tensor, want: torch.Tensor, sd: torch.dtype) -> None:
    """Decoded values: same positions as the C op, values up to rounding.

    A position is peeled from whichever of its buckets reaches count 1 first,
    which differs between the C queue and the GPU rounds.  Exact buckets give
    the same value either way (fp32 rounding aside); a bf16 sketch rounds each
    bucket differently, and the difference travels down peeling chains, so
    there the values (O(1) here) must agree to bf16 precision almost
    everywhere and stay bounded everywhere.
    """
    if sd == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    diff = (got - want).abs()
    assert float((diff > 0.03).float().mean()) < 0.01, diff.max()
    assert float(diff.max()) < 0.5


PEEL_CASES = [  # sketch dtype, n, union (two ranks), buckets per entry, rounds, estimate
    (torch.float32, 40, 0, 1.5, 96, 1),
    (torch.float32, 3000, 200, 1.6, 96, 1),
    (torch.float32, 8000, 800, 1.3, 96, 0),
    (torch.float32, 8000, 800, 0.8, 96, 1),  # undersized: peeling stalls
    (torch.float32, 5000, 1500, 0.3, 96, 0),
    (torch.float32, 8000, 800, 1.3, 2, 1),   # rounds run out
    (torch.bfloat16, 3000, 200, 1.6, 96, 0),
    (torch.bfloat16, 8000, 800, 1.3, 96, 1),
    (torch.bfloat16, 8000, 800, 0.8, 96, 0),
]


@pytest.mark.parametrize("sd,n,u,c,rounds,estimate", PEEL_CASES)
def test_peel_decode(lib: C.CDLL, sd: torch.dtype, n: int, u: int, c: float, rounds: int,
                     estimate: int) -> None:
    t, seed, sk, union = two_rank_sketch(_tagc, n, u, c, sd)
    bm = bitmap_of(union)
    usize = int(union.sum())
    c_out = torch.full((n,), 3.0)
    c_unp = torch.full((usize + 1,), -1, dtype=torch.int32)
    c_cnt = _tagc.peel_decode(c_out, sk, bm, n, t, seed, unpeeled=c_unp,
                              estimate=bool(estimate))
    e_out = torch.full((n,), 3.0)
    e_unp = torch.full((usize + 1,), -1, dtype=torch.int32)
    cnt = torch.full((1,), -1, dtype=torch.int64)
    w = ws(lib.tagc_cuda_peel_decode_workspace_size(n, t, rounds))
    st = lib.tagc_cuda_peel_decode(P(e_out), n, P(e_unp), e_unp.numel(), P(cnt), P(sk), DT[sd],
                                   P(bm), n, t, seed, estimate, rounds, P(w), w.numel(), None)
    assert st == 0
    if rounds < 10 and c_cnt == 0:
        # Too few rounds for this sketch: what is left is reported, never lost.
        assert 0 < int(cnt) <= usize
        left = e_unp[:int(cnt)].long()
        assert torch.all(left[1:] > left[:-1])
        assert bool(union[left].all())
        peeled = union.clone()
        peeled[left] = False
        assert_peel_close(e_out[peeled], c_out[peeled], sd)
        return
    assert int(cnt) == c_cnt
    assert torch.equal(e_unp, c_unp)
    assert_peel_close(e_out, c_out, sd)


@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 700])
def test_sparse_pack_unpack(lib: C.CDLL, vd: torch.dtype, k: int) -> None:
    n = 3000
    idx, val = kept(n, k, vd, seed=k)
    es = 4 + torch.empty(0, dtype=vd).element_size()
    c_buf = torch.full((k * es + 3,), 0xEE, dtype=torch.uint8)
    _tagc.sparse_pack(c_buf[1:1 + k * es], idx, val)
    e_buf = torch.full((k * es + 3,), 0xEE, dtype=torch.uint8)
    assert lib.tagc_cuda_sparse_pack(P(e_buf[1:]), k * es, P(idx), P(val), DT[vd], k, None) == 0
    assert torch.equal(e_buf, c_buf)
    base = gradient(n, torch.float32, False, seed=5)
    c_out = base.clone()
    _tagc.sparse_unpack(c_out, c_buf[1:1 + k * es].clone(), k, vd)
    e_out = base.clone()
    w = ws(lib.tagc_cuda_sparse_unpack_workspace_size())
    assert lib.tagc_cuda_sparse_unpack(P(e_out), n, P(e_buf[1:]), k * es, k, DT[vd], None,
                                       P(w), w.numel(), None) == 0
    assert same_bits(e_out, c_out)


def test_sparse_unpack_corrupt(lib: C.CDLL) -> None:
    buf = torch.empty(24, dtype=torch.uint8)
    _tagc.sparse_pack(buf, torch.tensor([3, 70_000, 5], dtype=torch.int32), torch.ones(3))
    out = torch.zeros(100)
    status = torch.zeros(1, dtype=torch.int32)
    w = ws(lib.tagc_cuda_sparse_unpack_workspace_size())
    assert lib.tagc_cuda_sparse_unpack(P(out), 100, P(buf), 24, 3, F32, P(status), P(w),
                                       w.numel(), None) == 0
    assert int(status) == ERR_CORRUPT
    assert not out.any()


def quant_encode(lib: C.CDLL, grad: torch.Tensor, res: Optional[torch.Tensor], fmt: str,
                 block: int, at: int = 1) -> torch.Tensor:
    """The emulated encoder's bytes, written ``at`` bytes into a larger buffer:
    1 puts the records at an odd address (the element-wise route), 4 keeps
    them word-aligned (the vector route of int4/int8, given 16-byte aligned
    fp32 inputs and blocks a multiple of 8)."""
    nb = _tagc.quant_bytes(grad.numel(), fmt, block)
    buf = torch.full((nb + at + 1,), 0xEE, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_quant_encode_workspace_size())
    assert lib.tagc_cuda_quant_encode(P(buf[at:]), nb, P(res), DT.get(getattr(res, "dtype", None), 0),
                                      P(grad), DT[grad.dtype], grad.numel(), QFORMAT[fmt], block,
                                      P(w), w.numel(), None) == 0
    assert (buf[:at] == 0xEE).all() and buf[-1] == 0xEE
    return buf[at:-1].clone()


@pytest.mark.parametrize("fmt", list(QFORMAT))
@pytest.mark.parametrize("n,block", [(1, 256), (300, 64), (1000, 256), (777, 1), (2100, 1000),
                                     (3000, 8)])
@pytest.mark.parametrize("gd,rd", [(torch.float32, None), (torch.float32, torch.float32),
                                   (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("at,shift", [(1, 0), (4, 0), (4, 1)])
def test_quant_encode_decode(lib: C.CDLL, fmt: str, n: int, block: int, gd: torch.dtype,
                             rd: Optional[torch.dtype], at: int, shift: int) -> None:
    """The kernels write the C op's bytes and residual bit for bit (the block
    sums run in the same order), and decode to the same values, on either
    route: records at an odd byte, word-aligned (int4/int8 with fp32 inputs:
    the vector route for whole blocks, the tail block element-wise), and with
    the gradient and residual one element off 16-byte alignment."""
    grad = gradient(n + shift, gd, False, seed=n)[shift:]
    res = None if rd is None else (
        gradient(n + shift, torch.float32, False, seed=n + 1) * 0.2).to(rd)[shift:]
    c_res = None if res is None else res.clone()
    c_buf = torch.empty(_tagc.quant_bytes(n, fmt, block), dtype=torch.uint8)
    _tagc.quant_encode(c_buf, c_res, grad, fmt, block)
    e_res = None
    if res is not None:  # a copy at res's alignment
        e_res = torch.empty(n + shift, dtype=res.dtype)[shift:]
        e_res.copy_(res)
    e_buf = quant_encode(lib, grad, e_res, fmt, block, at)
    assert torch.equal(e_buf, c_buf)
    if res is not None:
        assert same_bits(e_res, c_res)
    base = gradient(n, torch.float32, False, seed=n + 2)
    c_out = base.clone()
    _tagc.quant_decode_add(c_out, c_buf, fmt, block)
    e_out = torch.empty(n + shift)[shift:]  # the sum at the gradient's alignment
    e_out.copy_(base)
    w = ws(lib.tagc_cuda_quant_decode_add_workspace_size())
    assert lib.tagc_cuda_quant_decode_add(P(e_out), n, P(e_buf), e_buf.numel(), QFORMAT[fmt],
                                          block, None, P(w), w.numel(), None) == 0
    assert same_bits(e_out, c_out)


@pytest.mark.parametrize("fmt", list(QFORMAT))
@pytest.mark.parametrize("at", [1, 4])
def test_quant_nonfinite_poisons_every_record(lib: C.CDLL, fmt: str, at: int) -> None:
    """NaN in one block: every scale NaN, residual untouched, every decoded
    value NaN (the C op raises NonFiniteError instead), on both routes."""
    grad = gradient(600, torch.float32, False, seed=3)
    grad[5] = float("nan")
    res = gradient(600, torch.float32, False, seed=4)
    r0 = res.clone()
    buf = quant_encode(lib, grad, res, fmt, 256, at)
    assert torch.equal(res, r0)
    out = torch.zeros(600)
    w = ws(lib.tagc_cuda_quant_decode_add_workspace_size())
    assert lib.tagc_cuda_quant_decode_add(P(out), 600, P(buf), buf.numel(), QFORMAT[fmt], 256,
                                          None, P(w), w.numel(), None) == 0
    assert torch.isnan(out).all()


def test_quant_decode_corrupt_leaves_out_untouched(lib: C.CDLL) -> None:
    buf = torch.empty(_tagc.quant_bytes(500, "ternary", 256), dtype=torch.uint8)
    _tagc.quant_encode(buf, None, gradient(500, torch.float32, False, seed=1), "ternary", 256)
    buf[70] = 250  # a code byte of the second record, not a base-3 byte
    out = torch.zeros(500)
    status = torch.zeros(1, dtype=torch.int32)
    w = ws(lib.tagc_cuda_quant_decode_add_workspace_size())
    assert lib.tagc_cuda_quant_decode_add(P(out), 500, P(buf), buf.numel(), 2, 256, P(status),
                                          P(w), w.numel(), None) == 0
    assert int(status) == ERR_CORRUPT
    assert not out.any()


def test_quant_argument_errors_match_c(lib: C.CDLL) -> None:
    """Synchronous errors: the shared checks (tagc_checks.h) give the C op's status."""
    g = torch.zeros(10)
    buf = torch.zeros(20, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_quant_encode_workspace_size())
    assert lib.tagc_cuda_quant_encode(P(buf), 8, None, 0, P(g), F32, 10, 4, 256, P(w),
                                      w.numel(), None) == 3  # CAPACITY
    assert lib.tagc_cuda_quant_encode(P(buf), 20, None, 0, P(g), F32, 10, 3, 256, P(w),
                                      w.numel(), None) == ERR_RANGE  # format
    assert lib.tagc_cuda_quant_encode(P(buf), 20, None, 0, P(g), F32, 10, 4, 0, P(w),
                                      w.numel(), None) == ERR_RANGE  # block
    assert lib.tagc_cuda_quant_decode_add(P(g), 10, P(buf), 10, 4, 256, None, P(w), w.numel(),
                                          None) == ERR_RANGE  # size


# ----------------------------------------------------------------------------- coded pairs
CODING = {"ef": 1, "bitmap": 2, "dense": 3}


@pytest.fixture(scope="module")
def cop() -> C.CDLL:
    """The C ops themselves (exported by the extension): their status codes,
    which the Python wrapper turns into exceptions."""
    dll = C.CDLL(_tagc.__file__)
    dll.tagc_pairs_pack.restype = INT
    dll.tagc_pairs_pack.argtypes = [VP, I64, VP, VP, INT, I64, I64, INT]
    dll.tagc_pairs_unpack_add.restype = INT
    dll.tagc_pairs_unpack_add.argtypes = [VP, I64, VP, I64, I64, INT, INT]
    dll.tagc_wq_encode.restype = INT
    dll.tagc_wq_encode.argtypes = [VP, I64, VP, INT, I64, VP, I64, INT, I64]
    dll.tagc_wq_decode.restype = INT
    dll.tagc_wq_decode.argtypes = [VP, INT, I64, VP, I64, VP, I64, INT, I64]
    dll.tagc_wq_delta_encode.restype = INT
    dll.tagc_wq_delta_encode.argtypes = [VP, I64, VP, VP, VP, INT, I64, VP, I64, INT, I64]
    dll.tagc_wq_delta_decode.restype = INT
    dll.tagc_wq_delta_decode.argtypes = [VP, VP, INT, I64, VP, I64, VP, I64, INT, I64]
    return dll


def pairs_pack(lib: C.CDLL, idx: torch.Tensor, val: torch.Tensor, n: int, coding: str,
               offset: int, status: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The emulated packer's bytes, written at `offset` into a larger buffer of
    0xEE (a message starts at any byte); the guard bytes must survive."""
    nb = _tagc.pairs_bytes(n, idx.numel(), val.dtype, coding)
    buf = torch.full((nb + offset + 2,), 0xEE, dtype=torch.uint8)
    assert lib.tagc_cuda_pairs_pack_workspace_size() == 0
    st = lib.tagc_cuda_pairs_pack(P(buf[offset:]), nb, P(idx), P(val), DT[val.dtype],
                                  idx.numel(), n, CODING[coding], P(status), None, 0, None)
    assert st == 0
    assert bool((buf[:offset] == 0xEE).all()) and bool((buf[offset + nb:] == 0xEE).all())
    return buf[offset:offset + nb].clone()


def pairs_unpack(lib: C.CDLL, out: torch.Tensor, msg: torch.Tensor, k: int, vd: torch.dtype,
                 coding: str, status: Optional[torch.Tensor] = None) -> None:
    """The emulated unpack of msg, read from byte 3 of a larger buffer."""
    src = torch.cat([torch.zeros(3, dtype=torch.uint8), msg])[3:]
    n = out.numel()
    w = ws(lib.tagc_cuda_pairs_unpack_add_workspace_size(n, k))
    st = lib.tagc_cuda_pairs_unpack_add(P(out), n, P(src), msg.numel(), k, DT[vd],
                                        CODING[coding], P(status), P(w), w.numel(), None)
    assert st == 0


PAIRS_SIZES = sorted({(n, k) for n in (1, 7, 64, 1000, 100_003)
                      for k in (0, 1, n // 80, n // 4, n)}
                     | {(300_000, 3750), (300_000, 75_000)})  # several scan tiles


@pytest.mark.parametrize("n,k", PAIRS_SIZES)
@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("coding", list(CODING))
def test_pairs_pack_unpack(lib: C.CDLL, n: int, k: int, vd: torch.dtype, coding: str) -> None:
    """The C op's bytes at any byte offset, and its sums bit for bit."""
    idx, val = kept(n, k, vd, seed=n + 3 * k)
    c_buf = torch.empty(_tagc.pairs_bytes(n, k, vd, coding), dtype=torch.uint8)
    _tagc.pairs_pack(c_buf, idx, val, n, coding)
    status = torch.zeros(1, dtype=torch.int32)
    e_buf = pairs_pack(lib, idx, val, n, coding, offset=1 + (n + k) % 3, status=status)
    assert torch.equal(e_buf, c_buf)
    assert int(status) == 0
    base = gradient(n, torch.float32, False, seed=k)
    c_out = base.clone()
    _tagc.pairs_unpack_add(c_out, c_buf, k, vd, coding)
    e_out = base.clone()
    pairs_unpack(lib, e_out, e_buf, k, vd, coding, status)
    assert int(status) == 0
    assert same_bits(e_out, c_out)


@pytest.mark.parametrize("coding", list(CODING))
def test_pairs_pack_bad_positions_set_range(lib: C.CDLL, coding: str) -> None:
    """Positions out of [0, n) or not strictly ascending: RANGE on the device,
    nothing written outside the message (its own bytes are unspecified)."""
    idx, _ = kept(5000, 700, torch.float32, seed=1)
    dup = idx.clone()
    dup[400] = dup[399]  # far from block 0
    swap = idx.clone()
    swap[[300, 301]] = swap[[301, 300]]
    big = idx.clone()
    big[-1] = 5000
    cases = [(10, [0, 0, 1]), (10, [2, 1, 3]), (10, [0, 1, 10]), (10, [-1, 2, 3]),
             (5000, dup), (5000, swap), (5000, big)]
    for n, bad in cases:
        bad = torch.as_tensor(bad, dtype=torch.int32)
        val = torch.ones(bad.numel())
        with pytest.raises(ValueError, match="ascending"):
            _tagc.pairs_pack(torch.empty(_tagc.pairs_bytes(n, bad.numel(), torch.float32,
                                                           coding), dtype=torch.uint8),
                             bad, val, n, coding)
        status = torch.zeros(1, dtype=torch.int32)
        pairs_pack(lib, bad, val, n, coding, offset=1, status=status)
        assert int(status) == ERR_RANGE


def corrupt_trials(clean: bytes, pos_bytes: int, trials: int, seed: int):
    """The clean message, then `trials` copies with 1-3 bits of the position
    part flipped."""
    rng = np.random.default_rng(seed)
    yield clean
    for trial in range(trials):
        b = bytearray(clean)
        for _ in range(1 + trial % 3):
            bit = int(rng.integers(pos_bytes * 8))
            b[bit // 8] ^= 1 << (bit % 8)
        yield bytes(b)


@pytest.mark.parametrize("coding", ["ef", "bitmap"])
@pytest.mark.parametrize("n,k", [(9, 1), (100, 3), (1000, 13), (1000, 400), (70_000, 300)])
def test_pairs_unpack_corrupt_matches_c(lib: C.CDLL, coding: str, n: int, k: int) -> None:
    """Bit flips in the positions: CORRUPT on the device and out untouched
    exactly when the C op refuses the message, the C op's sums otherwise."""
    idx, val = kept(n, k, torch.float32, seed=n - k)
    clean = torch.empty(_tagc.pairs_bytes(n, k, torch.float32, coding), dtype=torch.uint8)
    _tagc.pairs_pack(clean, idx, val, n, coding)
    base = gradient(n, torch.float32, False, seed=n)
    refused = 0
    for msg in corrupt_trials(clean.numpy().tobytes(), clean.numel() - 4 * k, 40, seed=n * k):
        buf = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        c_out = base.clone()
        ok = c_accepts(c_out, buf, k, coding)
        e_out = base.clone()
        status = torch.zeros(1, dtype=torch.int32)
        pairs_unpack(lib, e_out, buf, k, torch.float32, coding, status)
        assert int(status) == (0 if ok else ERR_CORRUPT)
        assert same_bits(e_out, c_out if ok else base)
        refused += not ok
    assert refused > 0


def c_accepts(out: torch.Tensor, msg: torch.Tensor, k: int, coding: str) -> bool:
    """Whether the C op accepts msg (adding it to out) or refuses it as corrupt."""
    try:
        _tagc.pairs_unpack_add(out, msg, k, torch.float32, coding)
        return True
    except ValueError:
        return False


def test_pairs_unpack_corrupt_padding_and_order(lib: C.CDLL) -> None:
    """What random flips may miss: a set padding bit in each part, and two EF
    positions of one high part whose upper bits straddle a 32-bit word (the
    order check then reads the previous word's last bit) made equal or
    descending through their low parts."""
    n, k, l = 1003, 60, 4  # 240 low bits; upper 60 + 63 bits, 5 padding bits
    g = torch.Generator().manual_seed(3)
    idx = torch.cat([torch.randperm(496, generator=g)[:32].sort().values,
                     torch.tensor([501, 505]),  # high part 31: upper bits 63 and 64
                     506 + torch.randperm(n - 506, generator=g)[:k - 34].sort().values])
    idx, val = idx.to(torch.int32), torch.randn(k, generator=g)
    msgs = {}
    for coding in ("ef", "bitmap"):
        msgs[coding] = torch.empty(_tagc.pairs_bytes(n, k, torch.float32, coding),
                                   dtype=torch.uint8)
        _tagc.pairs_pack(msgs[coding], idx, val, n, coding)
    lo_bytes, up_bytes = (k * l + 7) // 8, (k + ((n - 1) >> l) + 1 + 7) // 8

    def with_low33(low: int) -> torch.Tensor:
        b = msgs["ef"].clone()
        for i in range(l):
            pos = 33 * l + i
            b[pos // 8] = (int(b[pos // 8]) & ~(1 << pos % 8)) | ((low >> i) & 1) << pos % 8
        return b

    bad = [("ef", with_low33(5)), ("ef", with_low33(3))]  # 501, 501 / 501, 499
    b = msgs["ef"].clone()
    b[lo_bytes + up_bytes - 1] |= 0x80  # upper padding
    bad.append(("ef", b))
    b = msgs["bitmap"].clone()
    b[(n + 7) // 8 - 1] |= 0x80  # bitmap tail: n % 8 == 3
    bad.append(("bitmap", b))
    good = [("ef", msgs["ef"]), ("bitmap", msgs["bitmap"]), ("ef", with_low33(6))]
    for coding, msg in bad + good:
        c_out = torch.zeros(n)
        ok = c_accepts(c_out, msg, k, coding)
        out = torch.zeros(n)
        status = torch.zeros(1, dtype=torch.int32)
        pairs_unpack(lib, out, msg, k, torch.float32, coding, status)
        assert int(status) == (0 if ok else ERR_CORRUPT)
        assert same_bits(out, c_out if ok else torch.zeros(n))
    assert [c_accepts(torch.zeros(n), m, k, c) for c, m in bad + good] == [False] * 4 + [True] * 3


def test_pairs_argument_errors_match_c(lib: C.CDLL, cop: C.CDLL) -> None:
    """Synchronous errors: the shared checks (tagc_checks.h) give the C op's
    status for every bad argument; the workspace adds ARG / CAPACITY."""
    idx = torch.tensor([1, 4], dtype=torch.int32)
    val, buf, out = torch.ones(2), torch.zeros(64, dtype=torch.uint8), torch.zeros(10)
    ef_bytes = _tagc.pairs_bytes(10, 2, torch.float32, "ef")
    packs = [  # dst, capacity, idx, val, val dtype, k, n, coding
        (None, 64, idx, val, F32, 2, 10, 1), (buf, 64, None, val, F32, 2, 10, 1),
        (buf, 64, idx, None, F32, 2, 10, 2), (buf, 64, idx, val, 2, 2, 10, 1),
        (buf, 64, idx, val, F32, 2, 10, 0), (buf, 64, idx, val, F32, 2, 10, 4),
        (buf, 64, idx, val, F32, 11, 10, 1), (buf, 64, idx, val, F32, -1, 10, 1),
        (buf, 64, idx, val, F32, 2, 2 ** 31, 1), (buf, ef_bytes - 1, idx, val, F32, 2, 10, 1),
        (buf, 39, idx, val, F32, 2, 10, 3), (buf, 0, idx, val, F32, 0, 10, 3),
        (None, 0, None, None, F32, 0, 0, 1),
    ]
    for d, cap, i, v, vd, k, n, c in packs:
        want = cop.tagc_pairs_pack(P(d), cap, P(i), P(v), vd, k, n, c)
        got = lib.tagc_cuda_pairs_pack(P(d), cap, P(i), P(v), vd, k, n, c, None, None, 0, None)
        assert got == want, (d is None, cap, k, n, c, got, want)
    w = ws(lib.tagc_cuda_pairs_unpack_add_workspace_size(10, 2))
    unpacks = [  # out, n, src, src bytes, k, val dtype, coding
        (None, 10, buf, ef_bytes, 2, F32, 1), (out, 10, None, ef_bytes, 2, F32, 1),
        (out, 10, buf, ef_bytes, 2, 3, 1), (out, 10, buf, ef_bytes, 2, F32, 5),
        (out, 10, buf, ef_bytes - 1, 2, F32, 1), (out, 10, buf, ef_bytes + 1, 2, F32, 1),
        (out, 10, buf, 9, 2, F32, 2), (out, 10, buf, 40, 11, F32, 3),
        (out, 10, buf, 0, 0, F32, 1), (None, 0, None, 0, 0, F32, 2),
    ]
    for o, n, src, nb, k, vd, c in unpacks:
        want = cop.tagc_pairs_unpack_add(P(o), n, P(src), nb, k, vd, c)
        got = lib.tagc_cuda_pairs_unpack_add(P(o), n, P(src), nb, k, vd, c, None, P(w),
                                             w.numel(), None)
        assert got == want, (o is None, n, nb, k, c, got, want)
    assert not out.any()
    assert lib.tagc_cuda_pairs_unpack_add(P(out), 10, P(buf), ef_bytes, 2, F32, 1, None, None,
                                          0, None) == 1  # ARG: no workspace
    assert lib.tagc_cuda_pairs_unpack_add(P(out), 10, P(buf), ef_bytes, 2, F32, 1, None, P(w),
                                          w.numel() - 1, None) == 3  # CAPACITY
    small = lib.tagc_cuda_pairs_unpack_add_workspace_size(1000, 10)
    assert lib.tagc_cuda_pairs_unpack_add_workspace_size(2 ** 31 - 1, 2 ** 30) > small


# ----------------------------------------------------------------------------- weight gather
WQ_FORMAT = {"int4": 4, "int8": 8}


def wq_encode(lib: C.CDLL, x: torch.Tensor, segs: torch.Tensor, fmt: str, block: int,
              nbytes: int, status: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The emulated encoder's bytes, written at byte 1 of a larger buffer of
    0xEE; the guard bytes must survive (nothing written outside the message)."""
    buf = torch.full((nbytes + 2,), 0xEE, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_wq_encode_workspace_size(segs.numel()))
    assert lib.tagc_cuda_wq_encode(P(buf[1:]), nbytes, P(x), DT[x.dtype], x.numel(), P(segs),
                                   segs.numel(), WQ_FORMAT[fmt], block, P(status), P(w),
                                   w.numel(), None) == 0
    assert buf[0] == 0xEE and buf[-1] == 0xEE
    return buf[1:-1].clone()


def wq_decode(lib: C.CDLL, out: torch.Tensor, msg: torch.Tensor, segs: torch.Tensor, fmt: str,
              block: int, status: Optional[torch.Tensor] = None) -> None:
    """The emulated decode of msg, read from byte 3 of a larger buffer."""
    src = torch.cat([torch.zeros(3, dtype=torch.uint8), msg])[3:]
    w = ws(lib.tagc_cuda_wq_decode_workspace_size(segs.numel()))
    assert lib.tagc_cuda_wq_decode(P(out), DT[out.dtype], out.numel(), P(src), msg.numel(),
                                   P(segs), segs.numel(), WQ_FORMAT[fmt], block, P(status),
                                   P(w), w.numel(), None) == 0


def wq_segments(seed: int, count: int, most: int) -> list:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, most + 1, (count,), generator=g)
    lengths[torch.rand(count, generator=g) < 0.3] = 0
    return [int(v) for v in lengths]


WQ_SEGS = [[1], [0, 3, 0], [300], [257, 0, 0, 64, 1], wq_segments(1, 40, 200),
           wq_segments(2, 300, 20)]  # more segments than the prefix kernel's threads


@pytest.mark.parametrize("fmt", list(WQ_FORMAT))
@pytest.mark.parametrize("si", range(len(WQ_SEGS)))
@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("sd,od", [(torch.float32, torch.float32),
                                   (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.bfloat16)])
def test_wq_encode_decode(lib: C.CDLL, fmt: str, si: int, block: int, sd: torch.dtype,
                          od: torch.dtype) -> None:
    """The C op's bytes at any byte offset, and its values bit for bit."""
    segs = torch.tensor(WQ_SEGS[si], dtype=torch.int64)
    n = int(segs.sum())
    x = gradient(n, sd, si % 2 == 1, seed=n + block)
    c_buf = torch.empty(_tagc.wq_bytes(segs, fmt, block), dtype=torch.uint8)
    _tagc.wq_encode(c_buf, x, segs, fmt, block)
    status = torch.zeros(1, dtype=torch.int32)
    e_buf = wq_encode(lib, x, segs, fmt, block, c_buf.numel(), status)
    assert torch.equal(e_buf, c_buf) and int(status) == 0
    c_out = torch.full((n,), 3.0, dtype=od)
    _tagc.wq_decode(c_out, c_buf, segs, fmt, block)
    e_out = torch.full((n,), 3.0, dtype=od)
    wq_decode(lib, e_out, e_buf, segs, fmt, block, status)
    assert same_bits(e_out, c_out) and int(status) == 0


@pytest.mark.parametrize("fmt", list(WQ_FORMAT))
@pytest.mark.parametrize("od", [torch.float32, torch.bfloat16])
def test_wq_nonfinite_blocks_decode_to_nan(lib: C.CDLL, fmt: str, od: torch.dtype) -> None:
    """NaN/Inf: the sentinel record, as the C op; the CUDA decode writes NaN
    over those blocks, decodes the others and reports NONFINITE (the C op
    raises NonFiniteError with out untouched)."""
    segs = torch.tensor([100, 0, 130], dtype=torch.int64)
    x = gradient(230, torch.float32, False, seed=4)
    x[[10, 205]] = torch.tensor([float("nan"), float("-inf")])  # blocks [0, 64), [164, 228)
    c_buf = torch.empty(_tagc.wq_bytes(segs, fmt, 64), dtype=torch.uint8)
    _tagc.wq_encode(c_buf, x, segs, fmt, 64)
    e_buf = wq_encode(lib, x, segs, fmt, 64, c_buf.numel())
    assert torch.equal(e_buf, c_buf)
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.wq_decode(torch.zeros(230, dtype=od), c_buf, segs, fmt, 64)
    out = torch.zeros(230, dtype=od)
    status = torch.zeros(1, dtype=torch.int32)
    wq_decode(lib, out, e_buf, segs, fmt, 64, status)
    assert int(status) == ERR_NONFINITE
    bad = torch.zeros(230, dtype=torch.bool)
    bad[:64] = bad[164:228] = True
    assert torch.isnan(out[bad]).all()
    clean = x.clone()
    clean[[10, 205]] = 0.0
    c_out = torch.zeros(230, dtype=od)
    _tagc.wq_decode(c_out, _tagc_encoded(clean, segs, fmt, 64), segs, fmt, 64)
    assert same_bits(out[~bad], c_out[~bad])


def _tagc_encoded(x: torch.Tensor, segs: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    buf = torch.empty(_tagc.wq_bytes(segs, fmt, block), dtype=torch.uint8)
    _tagc.wq_encode(buf, x, segs, fmt, block)
    return buf


@pytest.mark.parametrize("fmt", list(WQ_FORMAT))
def test_wq_decode_corrupt_leaves_out_untouched(lib: C.CDLL, fmt: str) -> None:
    segs = torch.tensor([90, 0, 50], dtype=torch.int64)
    clean = _tagc_encoded(gradient(140, torch.float32, False, seed=1), segs, fmt, 32)
    rec = 4 + 32 // (2 if fmt == "int4" else 1)
    cases = []
    b = clean.clone()
    b[2 * rec + 4 + 5] = 0x80 if fmt == "int8" else 0xF7  # a code of the third record
    cases.append(b)
    for scale in (0x7FC00000, 0x7F800000, 0xBF800000):  # a NaN other than the sentinel, Inf, -1
        b = clean.clone()
        b[rec:rec + 4] = torch.tensor(list(scale.to_bytes(4, "little")), dtype=torch.uint8)
        cases.append(b)
    b = cases[0].clone()
    b[:4] = torch.tensor(list((0x7FC0FFEE).to_bytes(4, "little")), dtype=torch.uint8)
    cases.append(b)  # a sentinel too: still CORRUPT, nothing written
    for b in cases:
        with pytest.raises(ValueError, match="invalid scale"):
            _tagc.wq_decode(torch.zeros(140), b, segs, fmt, 32)
        out = torch.full((140,), 3.0)
        status = torch.zeros(1, dtype=torch.int32)
        wq_decode(lib, out, b, segs, fmt, 32, status)
        assert int(status) == ERR_CORRUPT
        assert bool((out == 3.0).all())


def test_wq_bad_tables_are_reported_on_the_device(lib: C.CDLL, cop: C.CDLL) -> None:
    """What the C op checks on the host from the table (a negative segment,
    sum != n, the message size) the launchers check in the prefix kernel:
    the C op's status in status_out, nothing written."""
    x = gradient(100, torch.float32, False, seed=2)
    nb = _tagc.wq_bytes([60, 40], "int8", 32)
    cases = [([60, 40], nb - 1), ([60, 41], nb), ([61, 40, -1], nb), ([50], nb),
             ([2 ** 40, -2 ** 40 + 100], nb), ([0] * 300 + [100], nb - 1)]
    for segs, cap in cases:
        seg_t = torch.tensor(segs, dtype=torch.int64)
        dst = torch.full((nb + 8,), 0xEE, dtype=torch.uint8)
        want = cop.tagc_wq_encode(P(dst), cap, P(x), F32, 100, P(seg_t), len(segs), 8, 32)
        assert want in (ERR_RANGE, ERR_CAPACITY) and bool((dst == 0xEE).all())
        status = torch.zeros(1, dtype=torch.int32)
        w = ws(lib.tagc_cuda_wq_encode_workspace_size(len(segs)))
        assert lib.tagc_cuda_wq_encode(P(dst), cap, P(x), F32, 100, P(seg_t), len(segs), 8, 32,
                                       P(status), P(w), w.numel(), None) == 0
        assert int(status) == want and bool((dst == 0xEE).all())
    msg = _tagc_encoded(x, torch.tensor([60, 40]), "int8", 32)
    for segs, nbytes in (([60, 40], nb - 1), ([60, 40], nb + 1), ([60, 39], nb), ([-1, 101], nb)):
        seg_t = torch.tensor(segs, dtype=torch.int64)
        out = torch.full((100,), 3.0)
        want = cop.tagc_wq_decode(P(out), F32, 100, P(msg), nbytes, P(seg_t), len(segs), 8, 32)
        assert want == ERR_RANGE
        status = torch.zeros(1, dtype=torch.int32)
        w = ws(lib.tagc_cuda_wq_decode_workspace_size(len(segs)))
        assert lib.tagc_cuda_wq_decode(P(out), F32, 100, P(msg), nbytes, P(seg_t), len(segs), 8,
                                       32, P(status), P(w), w.numel(), None) == 0
        assert int(status) == ERR_RANGE and bool((out == 3.0).all())


def test_wq_argument_errors_match_c(lib: C.CDLL, cop: C.CDLL) -> None:
    """Synchronous errors: the shared checks (tagc_checks.h) give the C op's
    status; an empty table is decided on the host too; the workspace adds
    ARG / CAPACITY."""
    x, seg = torch.zeros(10), torch.tensor([10], dtype=torch.int64)
    buf = torch.zeros(64, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_wq_encode_workspace_size(1))
    encodes = [  # dst, capacity, src, dtype, n, seg, nseg, format, block
        (None, 64, x, F32, 10, seg, 1, 8, 32), (buf, 64, None, F32, 10, seg, 1, 8, 32),
        (buf, 64, x, F32, 10, None, 1, 8, 32), (buf, 64, x, 2, 10, seg, 1, 8, 32),
        (buf, 64, x, F32, 10, seg, 1, 2, 32), (buf, 64, x, F32, 10, seg, 1, 1, 32),
        (buf, 64, x, F32, 10, seg, 1, 8, 0), (buf, 64, x, F32, 10, seg, 1, 4, 65537),
        (buf, 64, x, F32, -1, seg, 1, 8, 32), (buf, 64, x, F32, 10, seg, -1, 8, 32),
        (buf, 64, x, F32, 10, seg, 0, 8, 32), (buf, -1, x, F32, 0, seg, 0, 8, 32),
        (None, 0, None, F32, 0, None, 0, 8, 32),
    ]
    for d, cap, src, dt, n, sg, ns, f, b in encodes:
        want = cop.tagc_wq_encode(P(d), cap, P(src), dt, n, P(sg), ns, f, b)
        got = lib.tagc_cuda_wq_encode(P(d), cap, P(src), dt, n, P(sg), ns, f, b, None, P(w),
                                      w.numel(), None)
        assert got == want, (d is None, cap, n, ns, f, b, got, want)
    decodes = [  # out, dtype, n, src, src bytes, seg, nseg, format, block
        (None, F32, 10, buf, 14, seg, 1, 8, 32), (x, F32, 10, None, 14, seg, 1, 8, 32),
        (x, 3, 10, buf, 14, seg, 1, 8, 32), (x, F32, 10, buf, 14, seg, 1, 2, 32),
        (x, F32, 10, buf, 14, seg, 1, 8, 65537), (x, F32, 10, buf, 14, seg, 0, 8, 32),
        (x, F32, 0, buf, 1, seg, 0, 8, 32), (x, F32, 0, None, 0, None, 0, 4, 32),
    ]
    for o, dt, n, src, nb, sg, ns, f, b in decodes:
        want = cop.tagc_wq_decode(P(o), dt, n, P(src), nb, P(sg), ns, f, b)
        got = lib.tagc_cuda_wq_decode(P(o), dt, n, P(src), nb, P(sg), ns, f, b, None, P(w),
                                      w.numel(), None)
        assert got == want, (o is None, n, nb, ns, f, b, got, want)
    assert not x.any()
    assert lib.tagc_cuda_wq_encode(P(buf), 64, P(x), F32, 10, P(seg), 1, 8, 32, None, None, 0,
                                   None) == 1  # ARG: no workspace
    assert lib.tagc_cuda_wq_decode(P(x), F32, 10, P(buf), 14, P(seg), 1, 8, 32, None, P(w),
                                   w.numel() - 1, None) == 3  # CAPACITY
    assert lib.tagc_cuda_wq_decode_workspace_size(10 ** 6) > w.numel()


# ----------------------------------------------------------------------------- weights' change
def wq_delta_encode(lib: C.CDLL, src: torch.Tensor, sent: torch.Tensor, base: torch.Tensor,
                    segs: torch.Tensor, fmt: str, block: int, nbytes: int,
                    status: Optional[torch.Tensor] = None,
                    capacity: Optional[int] = None) -> torch.Tensor:
    """The emulated delta encoder's bytes (sent updated in place), written at
    byte 1 of a larger buffer of 0xEE whose guard bytes must survive."""
    buf = torch.full((nbytes + 2,), 0xEE, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_wq_delta_encode_workspace_size(segs.numel()))
    assert lib.tagc_cuda_wq_delta_encode(
        P(buf[1:]), nbytes if capacity is None else capacity, P(src), P(sent), P(base),
        DT[src.dtype], src.numel(), P(segs), segs.numel(), WQ_FORMAT[fmt], block, P(status),
        P(w), w.numel(), None) == 0
    assert buf[0] == 0xEE and buf[-1] == 0xEE
    return buf[1:-1].clone()


def wq_delta_decode(lib: C.CDLL, out: torch.Tensor, ref: torch.Tensor, msg: torch.Tensor,
                    segs: torch.Tensor, fmt: str, block: int,
                    status: Optional[torch.Tensor] = None,
                    nbytes: Optional[int] = None) -> None:
    """The emulated delta decode of msg, read from byte 3 of a larger buffer
    (out may be ref)."""
    src = torch.cat([torch.zeros(3, dtype=torch.uint8), msg])[3:]
    w = ws(lib.tagc_cuda_wq_delta_decode_workspace_size(segs.numel()))
    assert lib.tagc_cuda_wq_delta_decode(
        P(out), P(ref), DT[ref.dtype], ref.numel(), P(src),
        msg.numel() if nbytes is None else nbytes, P(segs), segs.numel(), WQ_FORMAT[fmt],
        block, P(status), P(w), w.numel(), None) == 0


def delta_inputs(n: int, dtype: torch.dtype, seed: int):
    """(base, src, sent): src is base with about half its values moved (the rest
    give d = 0), sent is src but for one 0.0 sent as -0.0 (equal as numbers,
    not as bits: the compare is bitwise)."""
    g = torch.Generator().manual_seed(seed)
    base = gradient(n, dtype, False, seed=seed)
    moved = torch.rand(n, generator=g) < 0.5
    src = torch.where(moved, base + (torch.randn(n, generator=g) / 64).to(dtype), base)
    src[n // 2] = 0.0
    sent = src.clone()
    sent[n // 2] = -0.0
    return base, src, sent


def c_delta_decode(out: Optional[torch.Tensor], ref: torch.Tensor, msg: torch.Tensor,
                   segs: torch.Tensor, fmt: str, block: int) -> None:
    _tagc.wq_delta_decode(out, ref, msg, segs, fmt, block)


@pytest.mark.parametrize("fmt", list(WQ_FORMAT))
@pytest.mark.parametrize("si", range(len(WQ_SEGS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wq_delta_encode_decode(lib: C.CDLL, fmt: str, si: int, dtype: torch.dtype) -> None:
    """A changed shard: the C op's bytes and sent; every receiver's ref and out
    bit for bit, in place or not.  Then the same shard again: all zeros, sent
    untouched (a NaN equals itself), and a decode that only copies ref."""
    segs = torch.tensor(WQ_SEGS[si], dtype=torch.int64)
    n, block = int(segs.sum()), (7, 64)[si % 2]
    in_place = (si + (dtype == torch.bfloat16)) % 2 == 0
    nb = _tagc.wq_delta_bytes(segs, fmt, block)
    assert nb == _tagc.wq_bytes(segs, fmt, block) + 1
    base, src, sent = delta_inputs(n, dtype, seed=si + 10 * n)
    c_sent, e_sent = sent.clone(), sent.clone()
    c_buf = torch.empty(nb, dtype=torch.uint8)
    _tagc.wq_delta_encode(c_buf, src, c_sent, base, segs, fmt, block)
    status = torch.zeros(1, dtype=torch.int32)
    e_buf = wq_delta_encode(lib, src, e_sent, base, segs, fmt, block, nb, status)
    assert int(status) == 0 and int(c_buf[-1]) == 1
    assert torch.equal(e_buf, c_buf)
    assert same_bits(e_sent, c_sent) and same_bits(e_sent, src)

    ref0 = gradient(n, dtype, True, seed=n)
    c_ref, e_ref = ref0.clone(), ref0.clone()
    c_out = None if in_place else torch.full((n,), 3.0, dtype=dtype)
    e_out = e_ref if in_place else torch.full((n,), 3.0, dtype=dtype)
    c_delta_decode(c_out, c_ref, c_buf, segs, fmt, block)
    wq_delta_decode(lib, e_out, e_ref, e_buf, segs, fmt, block, status)
    assert int(status) == 0 and same_bits(e_ref, c_ref)
    assert same_bits(e_out, c_ref)

    src[n - 1] = c_sent[n - 1] = e_sent[n - 1] = float("nan")
    _tagc.wq_delta_encode(c_buf, src, c_sent, base, segs, fmt, block)
    e_buf = wq_delta_encode(lib, src, e_sent, base, segs, fmt, block, nb, status)
    assert int(status) == 0 and not c_buf.any() and not e_buf.any()
    assert same_bits(e_sent, c_sent)
    e_out = e_ref if in_place else torch.full((n,), 3.0, dtype=dtype)
    before = e_ref.clone()
    wq_delta_decode(lib, e_out, e_ref, e_buf, segs, fmt, block, status)
    assert int(status) == 0 and same_bits(e_ref, before) and same_bits(e_out, before)


@pytest.mark.parametrize("fmt", list(WQ_FORMAT))
def test_wq_delta_decode_corrupt_leaves_out_and_ref_untouched(lib: C.CDLL, fmt: str) -> None:
    """A flag byte other than 0 or 1, or a bad code or scale under flag 1:
    CORRUPT, nothing written.  Under flag 0 the codes are not read, so a bad
    one there still gives out = ref, as the C op."""
    segs = torch.tensor([90, 0, 50], dtype=torch.int64)
    base, src, sent = delta_inputs(140, torch.float32, seed=5)
    clean = torch.empty(_tagc.wq_delta_bytes(segs, fmt, 32), dtype=torch.uint8)
    _tagc.wq_delta_encode(clean, src, sent, base, segs, fmt, 32)
    rec = 4 + 32 // (2 if fmt == "int4" else 1)
    bad_code = 0x80 if fmt == "int8" else 0xF7
    cases = []
    for flag in (2, 255):
        b = clean.clone()
        b[-1] = flag
        cases.append(b)
    b = clean.clone()
    b[2 * rec + 4 + 5] = bad_code  # a code of the third record
    cases.append(b)
    b = clean.clone()
    b[rec:rec + 4] = torch.tensor(list((0xBF800000).to_bytes(4, "little")), dtype=torch.uint8)
    cases.append(b)  # scale -1
    ref0 = gradient(140, torch.float32, False, seed=6)
    for b in cases:
        with pytest.raises(ValueError):
            _tagc.wq_delta_decode(torch.zeros(140), ref0.clone(), b, segs, fmt, 32)
        for in_place in (False, True):
            ref = ref0.clone()
            out = ref if in_place else torch.full((140,), 3.0)
            status = torch.zeros(1, dtype=torch.int32)
            wq_delta_decode(lib, out, ref, b, segs, fmt, 32, status)
            assert int(status) == ERR_CORRUPT
            assert same_bits(ref, ref0) and (in_place or bool((out == 3.0).all()))
    b = torch.zeros_like(clean)
    b[2 * rec + 4 + 5] = bad_code
    c_out = torch.zeros(140)
    _tagc.wq_delta_decode(c_out, ref0.clone(), b, segs, fmt, 32)
    out, ref = torch.zeros(140), ref0.clone()
    status = torch.zeros(1, dtype=torch.int32)
    wq_delta_decode(lib, out, ref, b, segs, fmt, 32, status)
    assert int(status) == 0 and same_bits(out, c_out) and same_bits(ref, ref0)


@pytest.mark.parametrize("fmt,dtype", [("int4", torch.bfloat16), ("int8", torch.float32)])
def test_wq_delta_nonfinite_blocks_decode_to_nan(lib: C.CDLL, fmt: str,
                                                 dtype: torch.dtype) -> None:
    """A change with NaN/Inf: the sentinel record, as the C op; the CUDA decode
    writes NaN over those blocks of ref and out, adds the others' change and
    reports NONFINITE (the C op raises NonFiniteError, everything untouched)."""
    segs = torch.tensor([100, 0, 130], dtype=torch.int64)
    base, src, sent = delta_inputs(230, dtype, seed=7)
    src[[10, 205]] = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    nb = _tagc.wq_delta_bytes(segs, fmt, 64)
    c_buf = torch.empty(nb, dtype=torch.uint8)
    _tagc.wq_delta_encode(c_buf, src, sent.clone(), base, segs, fmt, 64)
    e_sent = sent.clone()
    e_buf = wq_delta_encode(lib, src, e_sent, base, segs, fmt, 64, nb)
    assert torch.equal(e_buf, c_buf) and same_bits(e_sent, src)
    ref0 = gradient(230, dtype, False, seed=8)
    ref = ref0.clone()
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.wq_delta_decode(None, ref, c_buf, segs, fmt, 64)
    assert same_bits(ref, ref0)
    out = torch.zeros(230, dtype=dtype)
    status = torch.zeros(1, dtype=torch.int32)
    wq_delta_decode(lib, out, ref, e_buf, segs, fmt, 64, status)
    assert int(status) == ERR_NONFINITE
    bad = torch.zeros(230, dtype=torch.bool)
    bad[:64] = bad[164:228] = True  # blocks [0, 64), [164, 228)
    assert torch.isnan(ref[bad]).all() and same_bits(out, ref)
    clean = src.clone()
    clean[[10, 205]] = base[[10, 205]]
    c_ref = ref0.clone()
    msg = torch.empty(nb, dtype=torch.uint8)
    _tagc.wq_delta_encode(msg, clean, sent.clone(), base, segs, fmt, 64)
    _tagc.wq_delta_decode(None, c_ref, msg, segs, fmt, 64)
    assert same_bits(ref[~bad], c_ref[~bad])


def test_wq_delta_bad_sizes_are_reported_on_the_device(lib: C.CDLL, cop: C.CDLL) -> None:
    """A capacity below the message, a message of the wrong size, a table not
    matching n: the C op's status in status_out, nothing written (dst, sent,
    out, ref)."""
    x = gradient(100, torch.float32, False, seed=2)
    base, sent = x / 2, x.clone()
    sent[3] += 1.0
    nb = _tagc.wq_delta_bytes([60, 40], "int8", 32)
    for segs, cap in (([60, 40], nb - 1), ([60, 40], 0), ([60, 41], nb), ([61, 40, -1], nb)):
        seg_t = torch.tensor(segs, dtype=torch.int64)
        dst, c_sent = torch.full((nb + 8,), 0xEE, dtype=torch.uint8), sent.clone()
        want = cop.tagc_wq_delta_encode(P(dst), cap, P(x), P(c_sent), P(base), F32, 100,
                                        P(seg_t), len(segs), 8, 32)
        assert want in (ERR_RANGE, ERR_CAPACITY) and bool((dst == 0xEE).all())
        status, e_sent = torch.zeros(1, dtype=torch.int32), sent.clone()
        w = ws(lib.tagc_cuda_wq_delta_encode_workspace_size(len(segs)))
        assert lib.tagc_cuda_wq_delta_encode(P(dst), cap, P(x), P(e_sent), P(base), F32, 100,
                                             P(seg_t), len(segs), 8, 32, P(status), P(w),
                                             w.numel(), None) == 0
        assert int(status) == want and bool((dst == 0xEE).all()) and same_bits(e_sent, sent)
    msg = torch.empty(nb, dtype=torch.uint8)
    _tagc.wq_delta_encode(msg, x, sent.clone(), base, torch.tensor([60, 40]), "int8", 32)
    for segs, nbytes in (([60, 40], nb - 1), ([60, 40], nb + 1), ([60, 39], nb)):
        seg_t = torch.tensor(segs, dtype=torch.int64)
        out, ref = torch.full((100,), 3.0), base.clone()
        want = cop.tagc_wq_delta_decode(P(out), P(ref), F32, 100, P(msg), nbytes, P(seg_t),
                                        len(segs), 8, 32)
        assert want == ERR_RANGE
        status = torch.zeros(1, dtype=torch.int32)
        wq_delta_decode(lib, out, ref, msg, seg_t, "int8", 32, status, nbytes=nbytes)
        assert int(status) == ERR_RANGE
        assert bool((out == 3.0).all()) and same_bits(ref, base)


def test_wq_delta_argument_errors_match_c(lib: C.CDLL, cop: C.CDLL) -> None:
    """Synchronous errors as the C op's; an empty table is decided on the host,
    its message the flag byte alone (a receiver still refuses a flag of 2)."""
    x, seg = torch.zeros(10), torch.tensor([10], dtype=torch.int64)
    sent, base = torch.ones(10), torch.zeros(10)
    buf = torch.zeros(64, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_wq_delta_encode_workspace_size(1))
    encodes = [  # dst, capacity, src, sent, base, dtype, n, seg, nseg, format, block
        (None, 64, x, sent, base, F32, 10, seg, 1, 8, 32),
        (buf, 64, None, sent, base, F32, 10, seg, 1, 8, 32),
        (buf, 64, x, None, base, F32, 10, seg, 1, 8, 32),
        (buf, 64, x, sent, None, F32, 10, seg, 1, 8, 32),
        (buf, 64, x, sent, base, 2, 10, seg, 1, 8, 32),
        (buf, 64, x, sent, base, F32, 10, seg, 1, 2, 32),
        (buf, 64, x, sent, base, F32, 10, seg, 1, 8, 0),
        (buf, 64, x, sent, base, F32, 10, None, 1, 8, 32),
        (buf, 64, x, sent, base, F32, 10, seg, 0, 8, 32),
        (buf, 64, x, None, None, F32, 10, seg, 0, 8, 32),
        (buf, 0, None, None, None, F32, 0, None, 0, 8, 32),
        (None, 1, None, None, None, F32, 0, None, 0, 8, 32),
    ]
    for d, cap, src, st, bs, dt, n, sg, ns, f, b in encodes:
        want = cop.tagc_wq_delta_encode(P(d), cap, P(src), P(st), P(bs), dt, n, P(sg), ns, f, b)
        got = lib.tagc_cuda_wq_delta_encode(P(d), cap, P(src), P(st), P(bs), dt, n, P(sg), ns,
                                            f, b, None, P(w), w.numel(), None)
        assert want != 0 and got == want, (cap, n, ns, f, b, got, want)
    assert not buf.any() and same_bits(sent, torch.ones(10))
    buf[:2] = 0xEE  # an empty table: the flag byte 0, alone
    assert cop.tagc_wq_delta_encode(P(buf), 1, None, None, None, F32, 0, None, 0, 8, 32) == 0
    assert buf[0] == 0 and buf[1] == 0xEE
    buf[0] = 0xEE
    assert lib.tagc_cuda_wq_delta_encode(P(buf), 1, None, None, None, F32, 0, None, 0, 8, 32,
                                         None, P(w), w.numel(), None) == 0
    assert buf[0] == 0 and buf[1] == 0xEE
    nb = _tagc.wq_delta_bytes(seg, "int8", 32)
    decodes = [  # out, ref, dtype, n, src, src bytes, seg, nseg, format, block
        (None, base, F32, 10, buf, nb, seg, 1, 8, 32), (x, None, F32, 10, buf, nb, seg, 1, 8, 32),
        (x, base, F32, 10, None, nb, seg, 1, 8, 32), (x, base, 3, 10, buf, nb, seg, 1, 8, 32),
        (x, base, F32, 10, buf, nb, seg, 1, 4, 65537), (x, base, F32, 10, buf, nb, seg, 0, 8, 32),
        (x, base, F32, 0, buf, 0, seg, 0, 8, 32), (x, base, F32, 0, buf, 2, seg, 0, 8, 32),
        (None, None, F32, 0, None, 1, None, 0, 4, 32),
    ]
    for o, r, dt, n, src, nbytes, sg, ns, f, b in decodes:
        want = cop.tagc_wq_delta_decode(P(o), P(r), dt, n, P(src), nbytes, P(sg), ns, f, b)
        got = lib.tagc_cuda_wq_delta_decode(P(o), P(r), dt, n, P(src), nbytes, P(sg), ns, f, b,
                                            None, P(w), w.numel(), None)
        assert want != 0 and got == want, (n, nbytes, ns, f, b, got, want)
    assert not x.any()
    for flag, want in ((0, 0), (1, 0), (2, ERR_CORRUPT)):
        buf[0] = flag
        assert cop.tagc_wq_delta_decode(None, None, F32, 0, P(buf), 1, None, 0, 8, 32) == want
        status = torch.zeros(1, dtype=torch.int32)
        assert lib.tagc_cuda_wq_delta_decode(None, None, F32, 0, P(buf), 1, None, 0, 8, 32,
                                             P(status), P(w), w.numel(), None) == 0
        assert int(status) == want
    assert lib.tagc_cuda_wq_delta_encode(P(buf), 64, P(x), P(sent), P(base), F32, 10, P(seg), 1,
                                         8, 32, None, None, 0, None) == 1  # ARG: no workspace
    assert lib.tagc_cuda_wq_delta_decode_workspace_size(10 ** 6) > w.numel()
