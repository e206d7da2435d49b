"""CUDA kernels of ``_tagc`` against the C codec on identical inputs (issue 6).

Each test runs an op twice on the same data: the C op on CPU tensors, and the
CUDA op on copies on the GPU, enqueued on a side stream with its scalar
outputs in 1-element device tensors (``out=`` / ``count_out=``, no host
sync), then compares.  Selection, sparsification, lanes, bitmaps and pair
packing must agree bit for bit; sketches and decoded values up to fp32
summation order (the GPU adds with atomics).

Skipped without a CUDA device or without a CUDA build of ``_tagc``
(``TAGC_BUILD_CUDA=1 pip install -e .``).  ``TAGC_CUDA_TEST_DEVICE=cpu`` runs
the same harness with the "device" side on the CPU as well: that checks only
this file's own code (both sides are then the C op), never CUDA.
"""
from __future__ import annotations

import math
from typing import ContextManager, Optional

import pytest
import torch

_tagc = pytest.importorskip("_tagc")
from tagc_bench.cuda_ops import side_stream as cuda_side_stream
from cuda_helpers import (DEV, SPARSIFY_DTYPES, bitmap_of, gradient, kept, needs_cuda,
                          same_bits, two_rank_sketch)

TAGC_ERR_RANGE = 2
TAGC_ERR_CORRUPT = 6

pytestmark = [needs_cuda(_tagc), pytest.mark.cuda, pytest.mark.codec]


# CUDA-only semantics (device NaN/status words instead of exceptions, out=
# required): nothing to run them against with TAGC_CUDA_TEST_DEVICE=cpu.
cuda_only = pytest.mark.skipif(DEV != "cuda", reason="CUDA-only semantics")


def side_stream() -> ContextManager[int]:
    """The stream handle to pass as ``stream=``; on CUDA a fresh side stream
    ordered after the current one, joined back and synchronized on exit so the
    test can read the results (tagc_bench.cuda_ops.side_stream)."""
    return cuda_side_stream(DEV)


def dev(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.to(DEV).contiguous()


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


SIZES = [(1, 1), (7, 3), (100, 0), (100, 100), (1000, 13), (4097, 50), (300_001, 3751)]


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_select_kth(n: int, k: int, dtype: torch.dtype, ties: bool) -> None:
    x = gradient(n, dtype, ties, seed=n + k)
    want = _tagc.select_kth(x, k)
    tau = torch.full((1,), -1.0, device=DEV)
    with side_stream() as s:
        assert _tagc.select_kth(dev(x), k, out=tau, stream=s) is None
    assert same_bits(host(tau), torch.tensor([want], dtype=torch.float32))
    if k == 0:
        assert math.isinf(want)


@cuda_only
def test_select_kth_nonfinite_gives_nan() -> None:
    x = gradient(5000, torch.float32, False, seed=1)
    x[4321] = float("inf")
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.select_kth(x, 10)
    tau = torch.zeros(1, device=DEV)
    with side_stream() as s:
        _tagc.select_kth(dev(x), 10, out=tau, stream=s)
    assert math.isnan(float(host(tau)))


def _sparsify_buffers(n: int, k: int, vd: torch.dtype, device: str):
    # Sentinels past every required length catch writes out of bounds.
    idx = torch.full((k + 3,), -7, dtype=torch.int32, device=device)
    val = torch.full((k + 3,), 9.0, dtype=vd, device=device)
    bm = torch.full(((n + 7) // 8 + 3,), 0xA5, dtype=torch.uint8, device=device)
    return idx, val, bm


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("gd,rd,vd", SPARSIFY_DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_sparsify(n: int, k: int, gd: torch.dtype, rd: Optional[torch.dtype],
                  vd: torch.dtype, ties: bool) -> None:
    g = gradient(n, gd, ties, seed=3 * n + k)
    r = None if rd is None else (gradient(n, torch.float32, ties, seed=n) / 8).to(rd)
    c_idx, c_val, c_bm = _sparsify_buffers(n, k, vd, "cpu")
    c_res = None if r is None else r.clone()
    want = _tagc.sparsify(c_idx[:k], c_val[:k], c_bm[:(n + 7) // 8], c_res, g, k)

    d_idx, d_val, d_bm = _sparsify_buffers(n, k, vd, DEV)
    d_res = dev(r)
    tau = torch.zeros(1, device=DEV)
    with side_stream() as s:
        assert _tagc.sparsify(d_idx[:k], d_val[:k], d_bm[:(n + 7) // 8], d_res,
                              dev(g), k, out=tau, stream=s) is None
    assert same_bits(host(tau), torch.tensor([want], dtype=torch.float32))
    assert torch.equal(host(d_idx), c_idx)
    assert same_bits(d_val, c_val)
    assert torch.equal(host(d_bm), c_bm)
    if r is not None:
        assert same_bits(d_res, c_res)


@cuda_only
def test_sparsify_nonfinite_outputs_nan_and_keeps_residual() -> None:
    n, k = 10_000, 40
    g = gradient(n, torch.float32, False, seed=5)
    g[777] = float("nan")
    r = gradient(n, torch.float32, False, seed=6) / 8
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.sparsify(torch.empty(k, dtype=torch.int32), torch.empty(k),
                       torch.empty((n + 7) // 8, dtype=torch.uint8), r.clone(), g, k)
    idx, val, bm = _sparsify_buffers(n, k, torch.float32, DEV)
    res = dev(r)
    tau = torch.zeros(1, device=DEV)
    with side_stream() as s:
        _tagc.sparsify(idx[:k], val[:k], bm[:(n + 7) // 8], res, dev(g), k, out=tau,
                       stream=s)
    assert math.isnan(float(host(tau)))
    assert same_bits(res, r)  # residual untouched
    assert torch.equal(host(idx[:k]), torch.arange(k, dtype=torch.int32))
    assert torch.isnan(host(val[:k])).all()
    want_bm = torch.zeros(n, dtype=torch.bool)
    want_bm[:k] = True
    bits = host(bm[:(n + 7) // 8])
    got = ((bits.long().unsqueeze(1) >> torch.arange(8)) & 1).view(-1)[:n].bool()
    assert torch.equal(got, want_bm)


def _random_bitmap(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return bitmap_of(torch.rand(n, generator=g) < density)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 9, 1000, 65_537])
def test_lanes_pack_and_unpack_of_summed_lanes(bits: int, n: int) -> None:
    nl = (n * bits + 7) // 8
    bms = [_random_bitmap(n, 0.3, seed=s) for s in range(3)]
    c_lanes = [torch.zeros(nl + 2, dtype=torch.uint8) for _ in bms]
    d_lanes = [torch.zeros(nl + 2, dtype=torch.uint8, device=DEV) for _ in bms]
    with side_stream() as s:
        for b, dl in zip(bms, d_lanes):
            _tagc.lanes_pack(dl, dev(b), n, bits, stream=s)
    for b, cl, dl in zip(bms, c_lanes, d_lanes):
        _tagc.lanes_pack(cl, b, n, bits)
        assert torch.equal(host(dl), cl)
    # The paper's SUM all-reduce of uint8 lanes, carries and wrap-around included.
    summed = (sum(cl.long() for cl in c_lanes) % 256).to(torch.uint8)[:nl]
    c_bm = torch.full(((n + 7) // 8 + 2,), 0x5A, dtype=torch.uint8)
    d_bm = dev(c_bm.clone())
    _tagc.lanes_unpack(c_bm, summed, n, bits)
    with side_stream() as s:
        _tagc.lanes_unpack(d_bm, dev(summed), n, bits, stream=s)
    assert torch.equal(host(d_bm), c_bm)


@pytest.mark.parametrize("nbytes,count", [(1, 1), (1000, 4), (12_345, 7)])
def test_bitmap_or(nbytes: int, count: int) -> None:
    src = torch.randint(0, 256, (count * nbytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(nbytes))
    c_dst = torch.full((nbytes + 1,), 0x33, dtype=torch.uint8)
    d_dst = dev(c_dst.clone())
    _tagc.bitmap_or(c_dst, src, count)
    with side_stream() as s:
        _tagc.bitmap_or(d_dst, dev(src), count, stream=s)
    assert torch.equal(host(d_dst), c_dst)


@pytest.mark.parametrize("n", [0, 1, 13, 8 * 1000, 1_000_003])
def test_popcount_ignores_tail_bits(n: int) -> None:
    bm = torch.randint(0, 256, ((n + 7) // 8 + 1,), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(n))
    want = _tagc.popcount(bm, n)
    cnt = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    with side_stream() as s:
        assert _tagc.popcount(dev(bm), n, out=cnt, stream=s) is None
    assert int(host(cnt)) == want


@pytest.mark.parametrize("sd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,t", [(100, 0, 5), (1000, 100, 50), (200_000, 2500, 1100)])
def test_sketch_encode(sd: torch.dtype, vd: torch.dtype, n: int, k: int, t: int) -> None:
    idx, val = kept(n, k, vd, seed=k)
    seed = _tagc.seed_derive(7, 3, 11)
    c_sk = torch.full((3 * t + 2,), 5.0, dtype=sd)
    _tagc.sketch_encode(c_sk[:3 * t], idx, val, n, t, seed)
    d_sk = dev(torch.full((3 * t + 2,), 5.0, dtype=sd))
    with side_stream() as s:
        _tagc.sketch_encode(d_sk[:3 * t], dev(idx), dev(val), n, t, seed, stream=s)
    got = host(d_sk)
    assert same_bits(got[3 * t:], c_sk[3 * t:])  # nothing past 3t written
    # Same terms, other summation order: fp32 rounding of the sums may differ.
    tol = dict(rtol=1e-5, atol=1e-5) if sd == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got[:3 * t].float(), c_sk[:3 * t].float(), **tol)


@cuda_only
def test_sketch_encode_bad_index_reports_range_on_device() -> None:
    idx = torch.tensor([1, 5, 99], dtype=torch.int32)
    val = torch.ones(3)
    with pytest.raises(ValueError):
        _tagc.sketch_encode(torch.zeros(30), idx, val, 50, 10, 1)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    with side_stream() as s:
        _tagc.sketch_encode(torch.zeros(30, device=DEV), dev(idx), dev(val), 50, 10, 1,
                            stream=s, status_out=status)
    assert int(host(status)) == TAGC_ERR_RANGE


@pytest.mark.parametrize("sd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,u,c", [(50, 0, 1.5), (2000, 150, 1.6), (300_000, 20_000, 1.3),
                                   (300_000, 20_000, 0.8), (5000, 3000, 0.3)])
@pytest.mark.parametrize("estimate", [True, False])
def test_peel_decode(sd: torch.dtype, n: int, u: int, c: float, estimate: bool) -> None:
    # Two ranks' kept sets; the owner decodes the sum of their sketches on the
    # union of their bitmaps, as in `exact` mode.
    t, seed, sk, union = two_rank_sketch(_tagc, n, u, c, sd)
    bm = bitmap_of(union)
    usize = int(union.sum())

    c_out = torch.full((n,), 3.0)
    c_unp = torch.full((usize + 1,), -1, dtype=torch.int32)
    c_cnt = _tagc.peel_decode(c_out, sk, bm, n, t, seed, unpeeled=c_unp, estimate=estimate)

    d_out = torch.full((n,), 3.0, device=DEV)
    d_unp = torch.full((usize + 1,), -1, dtype=torch.int32, device=DEV)
    cnt = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    with side_stream() as s:
        assert _tagc.peel_decode(d_out, dev(sk), dev(bm), n, t, seed, unpeeled=d_unp,
                                 estimate=estimate, count_out=cnt, stream=s) is None
    # Peeling is order-independent: the same positions stay unpeeled.
    assert int(host(cnt)) == c_cnt
    assert torch.equal(host(d_unp), c_unp)
    if c >= 1.3 and u >= 10_000:
        assert c_cnt == 0  # a properly sized sketch peels completely
    # Positions peel from whichever bucket reaches count 1 first (C queue vs
    # GPU rounds): equal values for exact buckets; bf16 buckets round each
    # one differently and the difference travels down peeling chains.
    if sd == torch.float32:
        torch.testing.assert_close(host(d_out), c_out, rtol=1e-4, atol=1e-4)
    else:
        diff = (host(d_out) - c_out).abs()
        assert float((diff > 0.03).float().mean()) < 0.01 and float(diff.max()) < 0.5


@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 3, 1001])
def test_sparse_pack_unaligned_and_unpack(vd: torch.dtype, k: int) -> None:
    n = 5000
    idx, val = kept(n, k, vd, seed=k + 1)
    es = 4 + torch.empty(0, dtype=vd).element_size()
    c_buf = torch.full((k * es + 3,), 0xEE, dtype=torch.uint8)
    _tagc.sparse_pack(c_buf[1:1 + k * es], idx, val)
    d_buf = dev(torch.full((k * es + 3,), 0xEE, dtype=torch.uint8))
    with side_stream() as s:  # slice at byte 1: not 4-byte aligned
        _tagc.sparse_pack(d_buf[1:1 + k * es], dev(idx), dev(val), stream=s)
    assert torch.equal(host(d_buf), c_buf)

    base = gradient(n, torch.float32, False, seed=9)
    c_out = base.clone()
    _tagc.sparse_unpack(c_out, c_buf[1:1 + k * es].clone(), k, vd)
    d_out = dev(base)
    with side_stream() as s:
        _tagc.sparse_unpack(d_out, d_buf[1:1 + k * es], k, vd, stream=s)
    assert same_bits(d_out, c_out)  # distinct offsets: one add per position


@cuda_only
def test_sparse_unpack_corrupt_leaves_out_untouched() -> None:
    idx = torch.tensor([3, 70_000, 5], dtype=torch.int32)
    val = torch.ones(3)
    buf = torch.empty(24, dtype=torch.uint8)
    _tagc.sparse_pack(buf, idx, val)
    with pytest.raises(ValueError):
        _tagc.sparse_unpack(torch.zeros(100), buf, 3, torch.float32)
    out = torch.zeros(100, device=DEV)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    with side_stream() as s:
        _tagc.sparse_unpack(out, dev(buf), 3, torch.float32, stream=s, status_out=status)
    assert int(host(status)) == TAGC_ERR_CORRUPT
    assert not host(out).any()


@cuda_only
def test_cuda_scalar_outputs_are_required() -> None:
    # Returning a Python number would need a host sync: CUDA calls must pass out=.
    with pytest.raises((TypeError, ValueError)):
        _tagc.select_kth(torch.ones(10, device=DEV), 3,
                         stream=torch.cuda.current_stream().cuda_stream)


@cuda_only
def test_work_is_ordered_on_the_given_stream() -> None:
    # A long select on a side stream, its result read on that stream: no
    # host sync inside _tagc, and the stream order alone makes it correct.
    x = gradient(4_000_000, torch.float32, False, seed=12)
    want = _tagc.select_kth(x, 1000)
    xd = dev(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    taus = torch.zeros(8, device=DEV)
    with torch.cuda.stream(s):
        for i in range(8):
            _tagc.select_kth(xd, 1000, out=taus[i:i + 1], stream=s.cuda_stream)
        copy = taus.clone()
    torch.cuda.synchronize()
    assert torch.equal(host(copy), torch.full((8,), want))


QFORMATS = ("sign", "ternary", "int4", "int8")


@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("n,block", [(1, 256), (1001, 256), (100_003, 256), (2_000_003, 1024)])
@pytest.mark.parametrize("gd,rd", [(torch.float32, torch.float32), (torch.bfloat16, None),
                                   (torch.float32, torch.bfloat16)])
def test_quant_encode_decode(fmt: str, n: int, block: int, gd: torch.dtype,
                             rd: Optional[torch.dtype]) -> None:
    """Bytes and residual bit for bit (the block sums run in the C op's order),
    records at an odd byte offset; decoding adds the same values."""
    grad = gradient(n, gd, False, seed=n)
    res = None if rd is None else (gradient(n, torch.float32, False, seed=n + 1) * 0.3).to(rd)
    nb = _tagc.quant_bytes(n, fmt, block)
    c_res = None if res is None else res.clone()
    c_buf = torch.empty(nb, dtype=torch.uint8)
    _tagc.quant_encode(c_buf, c_res, grad, fmt, block)
    d_res = dev(res)
    d_buf = dev(torch.full((nb + 1,), 0xEE, dtype=torch.uint8))
    with side_stream() as s:
        _tagc.quant_encode(d_buf[1:], d_res, dev(grad), fmt, block, stream=s)
    assert torch.equal(host(d_buf)[1:], c_buf) and int(host(d_buf)[0]) == 0xEE
    if res is not None:
        assert same_bits(host(d_res), c_res)
    base = gradient(n, torch.float32, False, seed=n + 2)
    c_out = base.clone()
    _tagc.quant_decode_add(c_out, c_buf, fmt, block)
    d_out = dev(base)
    with side_stream() as s:
        _tagc.quant_decode_add(d_out, d_buf[1:], fmt, block, stream=s)
    assert same_bits(host(d_out), c_out)


@cuda_only
@pytest.mark.parametrize("fmt", QFORMATS)
def test_quant_nonfinite_poisons_and_keeps_residual(fmt: str) -> None:
    grad = gradient(5000, torch.float32, False, seed=3)
    grad[4321] = float("nan")
    res = dev(gradient(5000, torch.float32, False, seed=4))
    r0 = host(res).clone()
    buf = torch.empty(_tagc.quant_bytes(5000, fmt, 256), dtype=torch.uint8, device=DEV)
    out = torch.zeros(5000, device=DEV)
    with side_stream() as s:
        _tagc.quant_encode(buf, res, dev(grad), fmt, 256, stream=s)
        _tagc.quant_decode_add(out, buf, fmt, 256, stream=s)
    assert torch.equal(host(res), r0) and torch.isnan(host(out)).all()


@cuda_only
def test_quant_decode_corrupt_leaves_out_untouched() -> None:
    buf = torch.empty(_tagc.quant_bytes(500, "int8", 256), dtype=torch.uint8)
    _tagc.quant_encode(buf, None, gradient(500, torch.float32, False, seed=1), "int8", 256)
    buf[300] = 0x80
    out = torch.zeros(500, device=DEV)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    with side_stream() as s:
        _tagc.quant_decode_add(out, dev(buf), "int8", 256, stream=s, status_out=status)
    assert int(host(status)) == TAGC_ERR_CORRUPT
    assert not host(out).any()


PAIRS_CODINGS = ("ef", "bitmap", "dense")


@pytest.mark.parametrize("coding", PAIRS_CODINGS)
@pytest.mark.parametrize("vd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1000, 0), (1000, 12), (1000, 250),
                                 (1000, 1000), (100_003, 1250), (2_000_003, 25_000),
                                 (2_000_003, 500_000)])
def test_pairs_pack_unaligned_and_unpack(coding: str, vd: torch.dtype, n: int, k: int) -> None:
    """Coded pairs: the C op's bytes at an odd byte offset (the scan over the
    bit array spans many tiles at 2M), and its sums bit for bit (distinct
    positions: one add each)."""
    idx, val = kept(n, k, vd, seed=n + k)
    nb = _tagc.pairs_bytes(n, k, vd, coding)
    c_buf = torch.empty(nb, dtype=torch.uint8)
    _tagc.pairs_pack(c_buf, idx, val, n, coding)
    d_buf = dev(torch.full((nb + 2,), 0xEE, dtype=torch.uint8))
    with side_stream() as s:
        _tagc.pairs_pack(d_buf[1:1 + nb], dev(idx), dev(val), n, coding, stream=s)
    got = host(d_buf)
    assert torch.equal(got[1:1 + nb], c_buf) and int(got[0]) == 0xEE and int(got[-1]) == 0xEE
    base = gradient(n, torch.float32, False, seed=k)
    c_out = base.clone()
    _tagc.pairs_unpack_add(c_out, c_buf, k, vd, coding)
    d_out = dev(base)
    with side_stream() as s:
        _tagc.pairs_unpack_add(d_out, d_buf[1:1 + nb], k, vd, coding, stream=s)
    assert same_bits(d_out, c_out)


@cuda_only
@pytest.mark.parametrize("coding", PAIRS_CODINGS)
def test_pairs_bad_positions_and_corrupt_messages_report_on_device(coding: str) -> None:
    n, k = 5000, 300
    idx, val = kept(n, k, torch.float32, seed=7)
    nb = _tagc.pairs_bytes(n, k, torch.float32, coding)
    bad = idx.clone()
    bad[200] = bad[199]
    with pytest.raises(ValueError):
        _tagc.pairs_pack(torch.empty(nb, dtype=torch.uint8), bad, val, n, coding)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    with side_stream() as s:
        _tagc.pairs_pack(torch.empty(nb, dtype=torch.uint8, device=DEV), dev(bad), dev(val), n,
                         coding, stream=s, status_out=status)
    assert int(host(status)) == TAGC_ERR_RANGE
    if coding == "dense":
        return  # nothing in a dense message can be inconsistent
    clean = torch.empty(nb, dtype=torch.uint8)
    _tagc.pairs_pack(clean, idx, val, n, coding)
    for bit in range(8 * (nb - 4 * k)):  # the first flip of the positions the C op refuses
        msg = clean.clone()
        msg[bit // 8] ^= 1 << bit % 8
        try:
            _tagc.pairs_unpack_add(torch.zeros(n), msg, k, torch.float32, coding)
        except ValueError:
            break
    else:
        pytest.fail("no refused flip")
    out = torch.zeros(n, device=DEV)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    with side_stream() as s:
        _tagc.pairs_unpack_add(out, dev(msg), k, torch.float32, coding, stream=s,
                               status_out=status)
    assert int(host(status)) == TAGC_ERR_CORRUPT
    assert not host(out).any()
