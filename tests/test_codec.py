"""Tests of the `_tagc` codec against plain torch/numpy references.

Independent re-implementations of docs/DESIGN.md section 3 and csrc/tagc_portable.h:
selection by a stable sort, the splitmix64 sketch hash in numpy uint64
arithmetic, lane layout by bit arrays.  Nothing here calls `_tagc`.
"""
from typing import Tuple

import numpy as np
import torch

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
TABLES = 3


def mix64_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (reference for seeds)."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return x


def seed_derive(seed: int, unit: int, step: int) -> int:
    """Per-call seed from (seed, unit, step), as tagc_seed_derive."""
    h = mix64_int(seed + GOLDEN)
    h = mix64_int(h ^ ((unit + GOLDEN) & M64))
    return mix64_int(h ^ ((step + 2 * GOLDEN) & M64))


def table_seed(seed: int, table: int) -> int:
    """Seed of sub-table `table`, as tagc_table_seed."""
    return mix64_int(seed + (table + 1) * GOLDEN)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def buckets_signs(pos: np.ndarray, t: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Bucket (3, k) int64 and sign (3, k) float32 of positions under a call seed."""
    p = pos.astype(np.uint64)
    bks, sgs = [], []
    with np.errstate(over="ignore"):
        for i in range(TABLES):
            h = _mix64_np(np.uint64(table_seed(seed, i)) + p * np.uint64(GOLDEN))
            b = ((h >> np.uint64(32)) * np.uint64(t)) >> np.uint64(32)
            bks.append(i * t + b.astype(np.int64))
            sgs.append(np.where((h & np.uint64(1)) == 1, -1.0, 1.0).astype(np.float32))
    return np.stack(bks), np.stack(sgs)


def sketch_ref(idx: torch.Tensor, val: torch.Tensor, t: int, seed: int) -> torch.Tensor:
    """Count sketch of (idx, val) pairs in float64 (3t buckets)."""
    b, s = buckets_signs(idx.numpy(), t, seed)
    out = torch.zeros(3 * t, dtype=torch.float64)
    v = val.double()
    for i in range(TABLES):
        out.index_add_(0, torch.from_numpy(b[i]), torch.from_numpy(s[i]).double() * v)
    return out


def topk_ref(v: torch.Tensor, k: int) -> torch.Tensor:
    """Kept positions (ascending): the k largest |v|, ties to lower positions."""
    order = torch.sort(v.abs(), descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def kth_ref(v: torch.Tensor, k: int) -> float:
    """k-th largest |v| (inf for k == 0)."""
    if k == 0:
        return float("inf")
    return torch.sort(v.float().abs(), descending=True).values[k - 1].item()


def bitmap_of(mask: torch.Tensor) -> torch.Tensor:
    """Packed 1-bit bitmap (LSB first) of a bool mask."""
    return torch.from_numpy(np.packbits(mask.numpy().astype(np.uint8), bitorder="little"))


def mask_of(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the first n bits of a bitmap."""
    bits = np.unpackbits(bitmap.numpy(), bitorder="little")[:n]
    return torch.from_numpy(bits.astype(bool))


def lanes_pack_ref(mask: torch.Tensor, bits: int) -> torch.Tensor:
    """Lanes of `bits` bits per position holding 1 for kept positions."""
    n = mask.numel()
    arr = np.zeros(n * bits, dtype=np.uint8)
    arr[np.arange(n) * bits] = mask.numpy().astype(np.uint8)
    return torch.from_numpy(np.packbits(arr, bitorder="little"))


def lanes_unpack_ref(lanes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Bool mask: lane p non-zero."""
    arr = np.unpackbits(lanes.numpy(), bitorder="little")[: n * bits].reshape(n, bits)
    return torch.from_numpy(arr.any(axis=1))

import math

import pytest

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

DT = {"f32": torch.float32, "bf16": torch.bfloat16}


def k_of(theta: float, n: int) -> int:
    """Entries kept per shard: ceil((1 - theta) * n), as DESIGN section 1."""
    return min(n, math.ceil(round((1.0 - theta) * n, 9)))


def run_sparsify(grad, residual, k, val_dtype=torch.float32):
    """Calls _tagc.sparsify with fresh outputs; returns (tau, idx, val, bitmap)."""
    n = grad.numel()
    idx = torch.full((k,), -7, dtype=torch.int32)
    val = torch.full((k,), 123.0, dtype=val_dtype)
    bitmap = torch.full(((n + 7) // 8,), 0xAA, dtype=torch.uint8)
    tau = _tagc.sparsify(idx, val, bitmap, residual, grad, k)
    return tau, idx, val, bitmap


def check_sparsify(grad, residual, k, val_dtype):
    """sparsify against the stable-sort reference, every output."""
    r0 = None if residual is None else residual.clone()
    v = grad.float() + (0 if r0 is None else r0.float())
    tau, idx, val, bitmap = run_sparsify(grad, residual, k, val_dtype)
    keep = topk_ref(v, k)
    assert torch.equal(idx.long(), keep)
    assert tau == kth_ref(v, k)
    want_val = v[keep].to(val_dtype)
    assert torch.equal(val, want_val)
    mask = torch.zeros(v.numel(), dtype=torch.bool)
    mask[keep] = True
    assert torch.equal(bitmap, bitmap_of(mask))
    if residual is not None:
        want_res = v.clone()
        want_res[keep] = v[keep] - want_val.float()
        assert torch.equal(residual, want_res.to(residual.dtype))
    return keep


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 1001, 65537])
@pytest.mark.parametrize("theta", [0.0, 0.5, 0.9875, "k=1"])
def test_sparsify_sizes_thetas(n, theta):
    g = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=g)
    residual = torch.randn(n, generator=g) * 0.1
    k = (1 if n else 0) if theta == "k=1" else k_of(theta, n)
    check_sparsify(grad, residual, k, torch.float32)


@pytest.mark.parametrize("gd", ["f32", "bf16"])
@pytest.mark.parametrize("rd", [None, "f32", "bf16"])
@pytest.mark.parametrize("vd", ["f32", "bf16"])
def test_sparsify_dtypes(gd, rd, vd):
    g = torch.Generator().manual_seed(3)
    n = 4099
    grad = torch.randn(n, generator=g).to(DT[gd])
    residual = None if rd is None else (torch.randn(n, generator=g) * 0.3).to(DT[rd])
    check_sparsify(grad, residual, k_of(0.9, n), DT[vd])


@pytest.mark.parametrize("kind", ["zeros", "equal", "neg_equal", "few_values", "signed_zero"])
@pytest.mark.parametrize("k", [1, 5, 500, 999, 1000])
def test_sparsify_ties(kind, k):
    n = 1000
    g = torch.Generator().manual_seed(k)
    grad = {
        "zeros": torch.zeros(n),
        "equal": torch.full((n,), 0.25),
        "neg_equal": torch.full((n,), 0.25) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0),
        "few_values": torch.randint(-2, 3, (n,), generator=g).float(),
        "signed_zero": torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0),
    }[kind]
    keep = check_sparsify(grad, torch.zeros(n), k, torch.float32)
    assert keep.numel() == k


@pytest.mark.parametrize("gd,rd,vd", [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"),
                                      ("f32", None, "bf16"), ("bf16", "f32", "f32")])
@pytest.mark.parametrize("theta", [0.9, 0.9875])
def test_sparsify_sampled_path(gd, rd, vd, theta):
    """Shards >= 2^15 take the bracket from a sample: heavy tails, dtypes, a tail."""
    g = torch.Generator().manual_seed(5)
    n = (1 << 17) + 37
    grad = (torch.randn(n, generator=g) ** 3).to(DT[gd])
    residual = None if rd is None else (torch.randn(n, generator=g) * 0.3).to(DT[rd])
    check_sparsify(grad, residual, k_of(theta, n), DT[vd])


@pytest.mark.parametrize("k", [1, 1000, 40000, 65536])
def test_sparsify_sampled_path_ties_and_misled_sample(k):
    """Many ties (the band outgrows its guess), and a sample that is misled:
    1.0 at the positions select.c samples (its formula, copied), 2.0 elsewhere,
    so the guessed bracket fails the count and the histogram takes over."""
    n = 1 << 16
    gen = torch.Generator().manual_seed(k)
    few = torch.randint(-2, 3, (n,), generator=gen).float()
    check_sparsify(few, torch.zeros(n), k, torch.float32)
    m, step = 16384, n // 16384
    i = torch.arange(m, dtype=torch.int64)
    pos = i * step + ((((i * 2654435761) % 2**32) >> 8) * step >> 24)
    grad = torch.full((n,), 2.0)
    grad[pos] = 1.0
    check_sparsify(grad, torch.randn(n, generator=gen) * 1e-3, k, torch.float32)


def test_sparsify_no_residual_keeps_grad():
    grad = torch.randn(513)
    g0 = grad.clone()
    tau, idx, val, bitmap = run_sparsify(grad, None, 17)
    assert torch.equal(grad, g0)
    assert torch.equal(val, grad[idx.long()])


def test_sparsify_k0():
    grad = torch.randn(100)
    res = torch.randn(100)
    v = grad + res
    tau, idx, val, bitmap = run_sparsify(grad, res, 0)
    assert tau == math.inf
    assert torch.equal(bitmap, torch.zeros(13, dtype=torch.uint8))
    assert torch.equal(res, v)


def test_sparsify_error_feedback_conserves_mass():
    """What is kept plus the new residual is exactly v = g + r (fp32 val)."""
    g = torch.Generator().manual_seed(11)
    n = 10_000
    res = torch.zeros(n)
    total_in = torch.zeros(n, dtype=torch.float64)
    total_out = torch.zeros(n, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(n, generator=g)
        total_in += grad.double()
        tau, idx, val, bitmap = run_sparsify(grad, res, 125)
        total_out.index_add_(0, idx.long(), val.double())
    torch.testing.assert_close(total_out + res.double(), total_in, rtol=0, atol=1e-5)


def test_sparsify_nonfinite_writes_nothing():
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad = torch.randn(100)
        grad[37] = bad
        res = torch.randn(100)
        r0 = res.clone()
        idx = torch.full((5,), -1, dtype=torch.int32)
        val = torch.full((5,), 9.0)
        bm = torch.full((13,), 0x55, dtype=torch.uint8)
        with pytest.raises(_tagc.NonFiniteError, match="NaN or Inf"):
            _tagc.sparsify(idx, val, bm, res, grad, 5)
        assert issubclass(_tagc.NonFiniteError, ValueError)
        assert torch.equal(res, r0)
        assert (idx == -1).all() and (val == 9.0).all() and (bm == 0x55).all()
    # Finite grad + finite residual that overflows to inf counts too.
    grad = torch.full((4,), 3e38)
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.sparsify(torch.zeros(1, dtype=torch.int32), torch.zeros(1),
                       torch.zeros(1, dtype=torch.uint8), grad.clone(), grad, 1)


def test_sparsify_out_tensor():
    grad = torch.randn(300)
    out = torch.zeros(1)
    r = _tagc.sparsify(torch.zeros(10, dtype=torch.int32), torch.zeros(10),
                       torch.zeros(38, dtype=torch.uint8), None, grad, 10, out=out)
    assert r is None and out.item() == kth_ref(grad, 10)


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1000, 100_003])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_select_kth(n, dt):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DT[dt])
    for k in sorted({0, 1, n // 2, k_of(0.9875, n), n}):
        if k <= n:
            assert _tagc.select_kth(x, k) == kth_ref(x, k)
    out = torch.zeros(1)
    if n:
        assert _tagc.select_kth(x, 1, out=out) is None
        assert out.item() == x.float().abs().max().item()


def test_select_kth_ties_and_nonfinite():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.0])
    assert [_tagc.select_kth(x, k) for k in range(1, 7)] == [3, 3, 3, 2, 1, 0]
    x[2] = float("nan")
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.select_kth(x, 1)


def test_sparsify_ten_million():
    """One >= 10^7 case: fp32 grad, bf16 residual, theta 0.9875."""
    n = 10_000_019
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(n, generator=g)
    grad[::97] = 0.5  # plant many exact ties near nothing in particular
    residual = (torch.randn(n, generator=g) * 0.01).to(torch.bfloat16)
    k = k_of(0.9875, n)
    check_sparsify(grad, residual, k, torch.float32)


# --- lanes, OR, popcount ----------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 64, 1003])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_lanes_roundtrip_and_layout(n, bits):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n + bits)) < 0.3
    bm = bitmap_of(mask)
    if n % 8:
        bm[-1] |= 0xFF << (n % 8) & 0xFF  # tail garbage must be ignored
    lanes = torch.full(((n * bits + 7) // 8,), 0xEE, dtype=torch.uint8)
    _tagc.lanes_pack(lanes, bm, n, bits)
    assert torch.equal(lanes, lanes_pack_ref(mask, bits))
    back = torch.full(((n + 7) // 8,), 0xFF, dtype=torch.uint8)
    _tagc.lanes_unpack(back, lanes, n, bits)
    assert torch.equal(back, bitmap_of(mask))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_lanes_sum_as_or(bits, ranks):
    """The paper's index all-reduce: uint8 SUM of lanes, carries and all."""
    n = 2003
    g = torch.Generator().manual_seed(bits * 10 + ranks)
    masks = [torch.rand(n, generator=g) < 0.2 for _ in range(ranks)]
    summed = torch.zeros((n * bits + 7) // 8, dtype=torch.int64)
    for m in masks:
        lanes = torch.empty_like(summed, dtype=torch.uint8)
        _tagc.lanes_pack(lanes, bitmap_of(m), n, bits)
        summed += lanes.long()
    summed = (summed & 0xFF).to(torch.uint8)  # what a uint8 SUM all-reduce yields
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    _tagc.lanes_unpack(out, summed, n, bits)
    assert torch.equal(mask_of(out, n), lanes_unpack_ref(summed, n, bits))
    union = torch.stack(masks).any(0)
    if (1 << bits) > ranks:  # no carry can leave a lane: exact OR
        assert torch.equal(mask_of(out, n), union)


def test_lanes_unpack_arbitrary_bytes():
    g = torch.Generator().manual_seed(5)
    for bits in (1, 2, 4, 8):
        for n in (1, 3, 9, 77):
            lanes = torch.randint(0, 256, ((n * bits + 7) // 8,), generator=g, dtype=torch.uint8)
            out = torch.empty((n + 7) // 8, dtype=torch.uint8)
            _tagc.lanes_unpack(out, lanes, n, bits)
            assert torch.equal(mask_of(out, n), lanes_unpack_ref(lanes, n, bits))
            if n % 8:  # bits past n are 0
                assert int(out[-1]) >> (n % 8) == 0


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("nbytes", [0, 1, 333])
def test_bitmap_or(count, nbytes):
    src = torch.randint(0, 256, (count * nbytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(count + nbytes))
    dst = torch.full((nbytes + 3,), 0x5A, dtype=torch.uint8)
    _tagc.bitmap_or(dst, src, count)
    want = src.view(count, nbytes).numpy()
    want = np.bitwise_or.reduce(want, axis=0) if nbytes else np.zeros(0, np.uint8)
    assert torch.equal(dst[:nbytes], torch.from_numpy(want))
    assert (dst[nbytes:] == 0x5A).all()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 100_001])
def test_popcount(n):
    bm = torch.randint(0, 256, ((n + 7) // 8 + 2,), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(n))
    want = int(mask_of(bm, n).sum())
    assert _tagc.popcount(bm, n) == want
    out = torch.zeros(1, dtype=torch.int64)
    assert _tagc.popcount(bm, n, out=out) is None and out.item() == want


# --- seeds, sketch, peel ------------------------------------------------------

def test_seed_derive_matches_reference():
    for s, u, st in [(0, 0, 0), (1, 2, 3), (2**64 - 1, 2**64 - 1, 2**64 - 1), (42, 7, 10**6)]:
        assert _tagc.seed_derive(s, u, st) == seed_derive(s, u, st)
    assert _tagc.seed_derive(0, 0, 1) != _tagc.seed_derive(0, 0, 2)


@pytest.mark.parametrize("sd", ["f32", "bf16"])
@pytest.mark.parametrize("vd", ["f32", "bf16"])
@pytest.mark.parametrize("k,t", [(0, 1), (1, 1), (1, 5), (300, 7), (3000, 1301)])
def test_sketch_encode(sd, vd, k, t):
    n = 50_000
    g = torch.Generator().manual_seed(k + t)
    idx = torch.randperm(n, generator=g)[:k].to(torch.int32)
    val = torch.randn(k, generator=g).to(DT[vd])
    seed = _tagc.seed_derive(9, k, t)
    sk = torch.full((3 * t + 2,), 77.0).to(DT[sd])
    _tagc.sketch_encode(sk, idx, val, n, t, seed)
    want = sketch_ref(idx.long(), val.float(), t, seed)
    torch.testing.assert_close(sk[: 3 * t].double(), want.to(DT[sd]).double(),
                               rtol=1e-2 if sd == "bf16" else 1e-5, atol=1e-5)
    assert (sk[3 * t:] == 77.0).all()


def exact_t(n: int, union_bound: int, c: float = 1.3) -> int:
    """Sub-table size of DESIGN section 4 `exact`: m ~ c * min(S, N*k), m = 3t."""
    return max(1, math.ceil(c * min(n, union_bound) / 3))


def make_ranks(n, k, ranks, gen, vd=torch.float32):
    """Per-rank sparsify outputs: [(idx, val)] and their bitmaps as rows of one tensor."""
    out = []
    bitmaps = torch.empty(ranks, (n + 7) // 8, dtype=torch.uint8)
    for r in range(ranks):
        grad = torch.randn(n, generator=gen) * torch.rand(1, generator=gen).item()
        idx = torch.empty(k, dtype=torch.int32)
        val = torch.empty(k, dtype=vd)
        _tagc.sparsify(idx, val, bitmaps[r], None, grad, k)
        out.append((idx, val))
    return out, bitmaps


def roundtrip(n, k, ranks, t, seed, gen, vd=torch.float32, sd=torch.float32):
    """Sum of ranks' sketches decoded with the OR of their bitmaps."""
    parts, bitmaps = make_ranks(n, k, ranks, gen, vd)
    total = torch.zeros(3 * t, dtype=torch.float32)
    truth = torch.zeros(n, dtype=torch.float64)
    for idx, val in parts:
        sk = torch.empty(3 * t, dtype=sd)
        _tagc.sketch_encode(sk, idx, val, n, t, seed)
        total += sk.float()
        truth.index_add_(0, idx.long(), val.double())
    total = total.to(sd)
    union = torch.empty((n + 7) // 8, dtype=torch.uint8)
    _tagc.bitmap_or(union, bitmaps, ranks)
    out = torch.full((n,), 5.0)
    unpeeled = torch.full((n,), -1, dtype=torch.int32)
    left = _tagc.peel_decode(out, total, union, n, t, seed, unpeeled=unpeeled)
    return out, truth, left, unpeeled, total, union


def assert_decoded(out, truth, union, n, rtol=1e-5):
    """Decoded values match the true sum on the union, 0 elsewhere (numpy:
    cheap on a loaded machine)."""
    o, tr = out.numpy().astype(np.float64), truth.numpy()
    on = mask_of(union, n).numpy()
    scale = np.abs(tr).max()
    err = np.abs(o - tr)
    assert err.max() <= rtol * scale, (err.max(), scale)
    assert not o[~on].any()


def test_roundtrip_exact_many_seeds():
    """N ranks, sketch sized as `exact` (m = 1.3 * min(S, N*k)): 0 unpeeled
    and the exact sum, over 50 (fixed) seeds with unions of 10^4..4*10^4."""
    gen = torch.Generator().manual_seed(2024)
    failures = []
    for trial in range(50):
        ranks = 2 + trial % 3
        theta = (0.9875, 0.95, 0.9)[(trial // 3) % 3]
        k = 6000 + 97 * trial
        n = math.ceil(k / (1 - theta))
        t = exact_t(n, ranks * k)
        seed = _tagc.seed_derive(0, trial, trial * 7 + 1)
        out, truth, left, _, _, union = roundtrip(n, k, ranks, t, seed, gen)
        assert _tagc.popcount(union, n) >= 10_000
        if left:
            failures.append((trial, left))
            continue
        assert_decoded(out, truth, union, n)
    assert failures == []


def test_roundtrip_small_union_is_exact_or_reports():
    """Small unions with c = 2.0: decoded exactly when nothing is left."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        n, k, ranks = 5000, 40, 3
        t = exact_t(n, ranks * k, c=2.0)
        out, truth, left, unp, _, union = roundtrip(n, k, ranks, t, trial, gen)
        bad = (out.double() - truth).abs() > 1e-5 * truth.abs().max().item()
        assert int(bad.sum()) <= left  # every wrong value was reported


@pytest.mark.parametrize("sd,vd", [("f32", "bf16"), ("bf16", "bf16"), ("bf16", "f32")])
def test_roundtrip_bf16(sd, vd):
    """bf16 values encode exactly into fp32 buckets; a bf16 sketch decodes as
    its fp32 widening would (its rounding is what peeling then carries)."""
    gen = torch.Generator().manual_seed(3)
    n, ranks = 200_000, 2
    k = k_of(0.9875, n)
    t = exact_t(n, ranks * k)
    out, truth, left, _, total, union = roundtrip(n, k, ranks, t, 99, gen, DT[vd], DT[sd])
    assert left == 0
    if sd == "f32":
        assert_decoded(out, truth, union, n)
    else:
        wide = torch.empty(n)
        assert _tagc.peel_decode(wide, total.float(), union, n, t, 99) == 0
        assert torch.equal(out, wide)
        on = mask_of(union, n)
        rel = ((out.double() - truth).abs()[on] / truth.abs().max()).median().item()
        assert rel < 2 ** -7  # typical error: bf16 rounding of a bucket sum


def test_undersized_sketch_estimates():
    gen = torch.Generator().manual_seed(17)
    n, k, ranks = 100_000, 2000, 2
    t = 700  # m = 2100 buckets for ~4000 keys: peeling must stall
    out, truth, left, unp, total, union = roundtrip(n, k, ranks, t, 1234, gen)
    assert left > 0
    pos = unp[:left].long()
    assert torch.equal(pos, torch.sort(pos).values) and (unp[left:] == -1).all()
    umask = mask_of(union, n)
    assert umask[pos].all()
    peeled = umask.clone()
    peeled[pos] = False
    scale = truth.abs().max().item()
    torch.testing.assert_close(out[peeled].double(), truth[peeled], rtol=1e-4, atol=1e-4 * scale)
    # median-of-3 of the sketch left after subtracting the peeled values
    pidx = peeled.nonzero().squeeze(1)
    rest = total.double() - sketch_ref(pidx, out[pidx], t, 1234)
    b, s = buckets_signs(pos.numpy(), t, 1234)
    est = torch.from_numpy(s).double() * rest[torch.from_numpy(b)]
    want = est.median(dim=0).values
    torch.testing.assert_close(out[pos].double(), want, rtol=1e-4, atol=1e-4 * scale)
    # estimate=False leaves them 0; a small unpeeled buffer gets the first ones
    out2 = torch.full((n,), 3.0)
    small = torch.full((5,), -1, dtype=torch.int32)
    left2 = _tagc.peel_decode(out2, total, union, n, t, 1234, unpeeled=small, estimate=False)
    assert left2 == left and torch.equal(small.long(), pos[:5])
    assert (out2[pos] == 0).all() and torch.equal(out2[peeled], out[peeled])
    cnt = torch.zeros(1, dtype=torch.int64)
    assert _tagc.peel_decode(out2, total, union, n, t, 1234, count_out=cnt) is None
    assert cnt.item() == left


def test_peel_empty_and_tiny():
    out = torch.full((0,), 1.0)
    assert _tagc.peel_decode(out, torch.zeros(3), torch.zeros(0, dtype=torch.uint8), 0, 1, 0) == 0
    # one position, one bucket per table
    sk = torch.empty(3)
    _tagc.sketch_encode(sk, torch.tensor([0], dtype=torch.int32), torch.tensor([2.5]), 1, 1, 5)
    out = torch.zeros(1)
    assert _tagc.peel_decode(out, sk, torch.tensor([1], dtype=torch.uint8), 1, 1, 5) == 0
    assert out.item() == 2.5


def test_peel_hostile_inputs_never_crash():
    """Garbage sketches (NaN/Inf bit patterns) and over-full bitmaps."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(1, 5000, (1,), generator=g))
        t = int(torch.randint(1, 50, (1,), generator=g))
        sk = torch.randint(-2**31, 2**31 - 1, (3 * t,), generator=g, dtype=torch.int32).view(torch.float32)
        nb = (n + 7) // 8
        bm = torch.full((nb,), 0xFF, dtype=torch.uint8) if trial % 2 else \
            torch.randint(0, 256, (nb,), generator=g, dtype=torch.uint8)
        out = torch.zeros(n + 4)
        out[n:] = 42.0
        unp = torch.zeros(3, dtype=torch.int32)
        left = _tagc.peel_decode(out, sk, bm, n, t, trial, unpeeled=unp)
        assert 0 <= left <= int(mask_of(bm, n).sum())
        assert (out[n:] == 42.0).all()
        assert ((unp >= 0) & (unp < n)).all() or left < 3


# --- sparse pairs -----------------------------------------------------------

@pytest.mark.parametrize("vd", ["f32", "bf16"])
@pytest.mark.parametrize("k", [0, 1, 77])
def test_sparse_pack_unpack(vd, k):
    g = torch.Generator().manual_seed(k)
    n = 1000
    idx = torch.randint(0, n, (k,), generator=g, dtype=torch.int32)  # duplicates add up
    val = torch.randn(k, generator=g).to(DT[vd])
    es = 4 if vd == "f32" else 2
    buf = torch.full((k * (4 + es) + 3,), 0xCC, dtype=torch.uint8)
    _tagc.sparse_pack(buf, idx, val)
    assert torch.equal(buf[: 4 * k], idx.view(torch.uint8))
    assert torch.equal(buf[4 * k: k * (4 + es)], val.view(torch.uint8))
    assert (buf[k * (4 + es):] == 0xCC).all()
    out = torch.randn(n, generator=g)
    want = out.double().index_add(0, idx.long(), val.double())
    _tagc.sparse_unpack(out, buf[: k * (4 + es)], k, DT[vd])
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_sparse_unpack_unaligned_buffer():
    idx = torch.tensor([3, 1], dtype=torch.int32)
    val = torch.tensor([1.5, -2.0])
    raw = torch.zeros(17, dtype=torch.uint8)
    _tagc.sparse_pack(raw[1:], idx, val)
    out = torch.zeros(4)
    _tagc.sparse_unpack(out, raw[1:], 2, torch.float32)
    assert out.tolist() == [0.0, -2.0, 0.0, 1.5]


@pytest.mark.parametrize("bad", [-1, 1000, 2**31 - 1])
def test_sparse_unpack_bad_offset_leaves_out_untouched(bad):
    idx = torch.tensor([5, bad, 7], dtype=torch.int32)
    buf = torch.empty(24, dtype=torch.uint8)
    _tagc.sparse_pack(buf, idx, torch.ones(3))
    out = torch.arange(1000, dtype=torch.float32)
    with pytest.raises(ValueError, match="offset"):
        _tagc.sparse_unpack(out, buf, 3, torch.float32)
    assert torch.equal(out, torch.arange(1000, dtype=torch.float32))


# --- bad inputs -------------------------------------------------------------

def _f(n):
    return torch.zeros(n)


def _u8(n):
    return torch.zeros(n, dtype=torch.uint8)


def _i32(n):
    return torch.zeros(n, dtype=torch.int32)


BAD = [
    # (callable, exception, text that must appear)
    (lambda: _tagc.select_kth(torch.zeros(5, dtype=torch.float64), 1), TypeError, "'x'"),
    (lambda: _tagc.select_kth(_f(5), 6), ValueError, "'k'"),
    (lambda: _tagc.select_kth(_f(5), -1), ValueError, "'k'"),
    (lambda: _tagc.select_kth([1.0, 2.0], 1), TypeError, "'x'"),
    (lambda: _tagc.select_kth(_f(10)[::2], 1), TypeError, "contiguous"),
    (lambda: _tagc.select_kth(torch.zeros(4, 4).t(), 1), TypeError, "contiguous"),
    (lambda: _tagc.select_kth(_f(5).requires_grad_(), 1), TypeError, "grad"),
    (lambda: _tagc.select_kth(torch.zeros(5, device="meta"), 1), TypeError, "'x'"),
    (lambda: _tagc.select_kth(_f(5), 1, out=_f(2)), ValueError, "'out'"),
    (lambda: _tagc.select_kth(_f(5), 1, out=_i32(1)), TypeError, "'out'"),
    (lambda: _tagc.select_kth(_f(5), 1.0), TypeError, "'k'"),
    (lambda: _tagc.sparsify(_i32(2), _f(3), _u8(2), None, _f(10), 3), ValueError, "'idx'"),
    (lambda: _tagc.sparsify(_i32(3), _f(2), _u8(2), None, _f(10), 3), ValueError, "'val'"),
    (lambda: _tagc.sparsify(_i32(3), _f(3), _u8(1), None, _f(10), 3), ValueError, "'bitmap'"),
    (lambda: _tagc.sparsify(_i32(3), _f(3), _u8(2), _f(9), _f(10), 3), ValueError, "'residual'"),
    (lambda: _tagc.sparsify(_i32(11), _f(11), _u8(2), None, _f(10), 11), ValueError, "'k'"),
    (lambda: _tagc.sparsify(_f(3), _f(3), _u8(2), None, _f(10), 3), TypeError, "'idx'"),
    (lambda: _tagc.sparsify(_i32(3), _f(3), _u8(2), None, torch.zeros(10, dtype=torch.float16), 3),
     TypeError, "'grad'"),
    (lambda: _tagc.sparsify(_i32(3), _f(3), _u8(2), _i32(10), _f(10), 3), TypeError, "'residual'"),
    (lambda: _tagc.sparsify(_i32(3), _f(3), _f(2), None, _f(10), 3), TypeError, "'bitmap'"),
    (lambda: _tagc.lanes_pack(_u8(8), _u8(8), 64, 3), ValueError, "'bits'"),
    (lambda: _tagc.lanes_pack(_u8(8), _u8(8), 64, 0), ValueError, "'bits'"),
    (lambda: _tagc.lanes_pack(_u8(15), _u8(8), 64, 2), ValueError, "'lanes'"),
    (lambda: _tagc.lanes_pack(_u8(16), _u8(7), 64, 2), ValueError, "'bitmap'"),
    (lambda: _tagc.lanes_pack(_u8(16), _u8(8), -1, 2), ValueError, "'n'"),
    (lambda: _tagc.lanes_unpack(_u8(8), _u8(63), 64, 8), ValueError, "'lanes'"),
    (lambda: _tagc.lanes_unpack(_u8(7), _u8(64), 64, 8), ValueError, "'bitmap'"),
    (lambda: _tagc.bitmap_or(_u8(4), _u8(9), 2), ValueError, "'src'"),
    (lambda: _tagc.bitmap_or(_u8(4), _u8(10), 2), ValueError, "'dst'"),
    (lambda: _tagc.bitmap_or(_u8(4), _u8(8), 0), ValueError, "'count'"),
    (lambda: _tagc.popcount(_u8(1), 9), ValueError, "'bitmap'"),
    (lambda: _tagc.popcount(_u8(2), 9, out=_f(1)), TypeError, "'out'"),
    (lambda: _tagc.sketch_encode(_f(8), _i32(1), _f(1), 10, 3, 0), ValueError, "'sketch'"),
    (lambda: _tagc.sketch_encode(_f(9), _i32(1), _f(1), 10, 0, 0), ValueError, "'t'"),
    (lambda: _tagc.sketch_encode(_f(9), _i32(1), _f(1), 10, 2**32, 0), ValueError, "'t'"),
    (lambda: _tagc.sketch_encode(_f(9), _i32(1), _f(1), 10, 3, -1), ValueError, "'seed'"),
    (lambda: _tagc.sketch_encode(_f(9), _i32(1), _f(1), 10, 3, 2**64), ValueError, "'seed'"),
    (lambda: _tagc.sketch_encode(_f(9), _i32(2), _f(1), 10, 3, 0), ValueError, "'val'"),
    (lambda: _tagc.sketch_encode(_f(9), torch.tensor([10], dtype=torch.int32), _f(1), 10, 3, 0),
     ValueError, "idx"),
    (lambda: _tagc.sketch_encode(_f(9), torch.tensor([-1], dtype=torch.int32), _f(1), 10, 3, 0),
     ValueError, "idx"),
    (lambda: _tagc.peel_decode(_f(9), _f(9), _u8(2), 10, 3, 0), ValueError, "'out'"),
    (lambda: _tagc.peel_decode(_f(10), _f(8), _u8(2), 10, 3, 0), ValueError, "'sketch'"),
    (lambda: _tagc.peel_decode(_f(10), _f(9), _u8(1), 10, 3, 0), ValueError, "'bitmap'"),
    (lambda: _tagc.peel_decode(_f(10), _f(9), _u8(2), 10, 0, 0), ValueError, "'t'"),
    (lambda: _tagc.peel_decode(_f(10), _f(9), _u8(2), 10, 3, -5), ValueError, "'seed'"),
    (lambda: _tagc.peel_decode(_f(10), _f(9), _u8(2), 10, 3, 0, unpeeled=_f(3)), TypeError, "'unpeeled'"),
    (lambda: _tagc.peel_decode(_f(10), _f(9), _u8(2), 10, 3, 0, count_out=_f(1)), TypeError, "'count_out'"),
    (lambda: _tagc.sparse_pack(_u8(15), _i32(2), _f(2)), ValueError, "'buf'"),
    (lambda: _tagc.sparse_pack(_u8(16), _i32(2), _f(3)), ValueError, "'val'"),
    (lambda: _tagc.sparse_unpack(_f(10), _u8(15), 2, torch.float32), ValueError, "'buf'"),
    (lambda: _tagc.sparse_unpack(_f(10), _u8(17), 2, torch.float32), ValueError, "'buf'"),
    (lambda: _tagc.sparse_unpack(_f(10), _u8(16), 2, torch.float16), TypeError, "value_dtype"),
    (lambda: _tagc.sparse_unpack(_f(10), _u8(16), -2, torch.float32), ValueError, "'k'"),
    (lambda: _tagc.seed_derive(-1, 0, 0), ValueError, "'seed'"),
    (lambda: _tagc.seed_derive(0, 2**64, 0), ValueError, "'unit'"),
]


def _overlapping() -> list:
    """Argument pairs that share memory: one buffer, two views (byte-level too)."""
    g = _f(16)
    u = torch.zeros(32, dtype=torch.uint8)
    return [
        lambda: _tagc.sparsify(_i32(3), g[:3], _u8(2), None, g, 3),
        lambda: _tagc.sparsify(_i32(3), _f(3), _u8(2), g, g, 3),
        lambda: _tagc.sparsify(g[4:7].view(torch.int32), _f(3), _u8(2), None, g[:10], 3),
        lambda: _tagc.bitmap_or(u[:4], u[2:10], 2),
        lambda: _tagc.bitmap_or(u[:4], u[3:11], 2),   # one byte shared
        lambda: _tagc.sparse_unpack(g[:4], g.view(torch.uint8)[8:24], 2, torch.float32),
        lambda: _tagc.peel_decode(g[:10], g[6:15], _u8(2), 10, 3, 0),
        lambda: _tagc.sketch_encode(g[:9], _i32(1), g[8:9], 10, 3, 0),
        lambda: _tagc.lanes_unpack(u[:8], u[0:16], 64, 2),
    ]


@pytest.mark.parametrize("case", range(9))
def test_overlapping_arguments_raise(case):
    fn = _overlapping()[case]
    with pytest.raises(ValueError, match="overlap in memory"):
        fn()


def test_adjacent_views_of_one_buffer_are_fine():
    buf = torch.zeros(24)
    x = buf[:16]
    x.copy_(torch.arange(16.0))
    idx, val = buf[16:20].view(torch.int32), buf[20:24]
    tau = _tagc.sparsify(idx, val, _u8(2), None, x, 4)
    assert tau == 12.0 and sorted(idx.tolist()) == [12, 13, 14, 15]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_raise(case):
    fn, exc, text = BAD[case]
    with pytest.raises(exc, match=text):
        fn()


def test_bad_capacity_writes_nothing():
    grad = torch.randn(100)
    res = torch.randn(100)
    r0 = res.clone()
    bm = _u8(13)
    with pytest.raises(ValueError):
        _tagc.sparsify(_i32(4), _f(5), bm, res, grad, 5)
    assert torch.equal(res, r0) and (bm == 0).all()


def test_cuda_tensor_is_refused_clearly():
    """Without the CUDA kernels a CUDA tensor gets a TypeError saying so."""
    assert isinstance(_tagc.cuda_available(), bool)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to make a CUDA tensor")
    if _tagc.cuda_available():
        pytest.skip("_tagc was built with the CUDA kernels")
    with pytest.raises(TypeError, match="without CUDA"):
        _tagc.select_kth(torch.zeros(4, device="cuda"), 1)


def test_scalar_result_types_do_not_leak_between_calls():
    """Omitted out=/count_out= must not change what later calls return."""
    bm = torch.full((2,), 0xFF, dtype=torch.uint8)
    assert _tagc.popcount(bm, 12) == 12
    tau = _tagc.select_kth(torch.tensor([1.0, -2.0]), 1)
    assert isinstance(tau, float) and tau == 2.0
    assert isinstance(_tagc.peel_decode(torch.zeros(1), torch.zeros(3), bm[:1], 1, 1, 0), int)
    assert isinstance(_tagc.sparsify(_i32(1), _f(1), _u8(1), None, torch.ones(3), 1), float)
