"""Codec benchmarks: every op ``scripts/bench/bench_codec.py`` reports, with memcpy beside them.

Each test times one codec op with pytest-benchmark on one shard of ``--bench-size``
fp32 entries (default 2^20) and then checks what the op wrote against a plain torch
reference, so that a benchmark measures a correct op and, run once as a plain test, is
a test.  ``setup.cfg`` passes ``--benchmark-disable``: the suite (and CI) runs each op
once and skips the timing.  As benchmarks:

    python3 scripts/bench/bench_codec.py           # the table (ratio to memcpy), JSON in --json
    python3 -m pytest tests/test_bench_codec.py --benchmark-enable --bench-size 4194304

memcpy is timed first and last (``dst.copy_(src)``, one fp32 shard): the two medians
bound how much the machine's load moved during the run, and the table divides by
their mean.  The codec is single-threaded; torch runs on one thread here so memcpy is
comparable (``torch.set_num_threads(1)`` in the fixture, restored after).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, Tuple

import pytest
import torch

from tagc.config import keep_count

pytestmark = [pytest.mark.bench, pytest.mark.codec]

THETAS = (0.9875, 0.9)
QUANT_FORMATS = ("int4", "ternary", "int8", "sign")
BLOCK = 256
RANKS = 2  # ranks whose sketches the owner's peel decode sums


@pytest.fixture(scope="module")
def size(request: pytest.FixtureRequest) -> int:
    """The shard length of every benchmark (``--bench-size``)."""
    n = int(request.config.getoption("--bench-size"))
    if n < BLOCK:
        raise pytest.UsageError(f"--bench-size must be >= {BLOCK}, got {n}")
    return n


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread while the module runs, like the single-threaded codec."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _grad(n: int, salt: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n + salt))


def _memcpy(benchmark: Callable, size: int) -> None:
    src, dst = _grad(size, 0), torch.empty(size)
    benchmark(dst.copy_, src)
    assert torch.equal(dst, src)


def test_memcpy(benchmark: Callable, size: int) -> None:
    """The yardstick, first in the run."""
    _memcpy(benchmark, size)


def _topk_reference(v: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest |v|, ties to the lower position (the codec's
    rule, csrc/tagc.h; an independent top-k).  torch.topk breaks ties as it likes: at
    2^24 fp32 values ties at the k-th magnitude are common, and it picked another of
    the tied entries."""
    order = torch.sort(v.abs(), descending=True, stable=True).indices[:k]
    return torch.sort(order).values


@pytest.mark.parametrize("theta", THETAS)
def test_select_sparsify(benchmark: Callable, size: int, theta: float) -> None:
    """Exact top-k + error feedback + bitmap, on a residual left by earlier calls."""
    import _tagc

    k = keep_count(theta, size)
    grads = [_grad(size, s) for s in (1, 2, 3)]
    residual = torch.zeros(size)
    idx, val = torch.empty(k, dtype=torch.int32), torch.empty(k)
    bitmap = torch.empty((size + 7) // 8, dtype=torch.uint8)
    turn = iter(range(10 ** 9))

    def call() -> None:
        # alternating gradients keep the residual as it is in training
        _tagc.sparsify(idx, val, bitmap, residual, grads[next(turn) % 3], k)

    benchmark(call)
    before, g = residual.clone(), grads[0]
    _tagc.sparsify(idx, val, bitmap, residual, g, k)
    v = g + before
    picked = torch.sort(idx.long()).values
    assert torch.equal(picked, _topk_reference(v, k))
    assert torch.equal(val, v[idx.long()])
    left = v.clone()
    left[idx.long()] = 0
    assert torch.equal(residual, left)


def _pairs(size: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k top-k pairs of a gradient, and the dense vector they stand for."""
    import _tagc

    k = keep_count(theta, size)
    g = _grad(size, 4)
    idx, val = torch.empty(k, dtype=torch.int32), torch.empty(k)
    bitmap = torch.empty((size + 7) // 8, dtype=torch.uint8)
    _tagc.sparsify(idx, val, bitmap, None, g, k)
    dense = torch.zeros(size)
    dense[idx.long()] = g[idx.long()]
    return idx, val, dense


@pytest.mark.parametrize("op", ("pack", "decode"))
@pytest.mark.parametrize("theta", THETAS)
def test_auto_pairs(benchmark: Callable, size: int, theta: float, op: str) -> None:
    """Mode ``auto``'s message of one rank's pairs (the coding it picks), and its decode."""
    import _tagc

    idx, val, dense = _pairs(size, theta)
    k = idx.numel()
    coding = _tagc.pairs_cheapest(size, k, torch.float32)
    msg = torch.empty(_tagc.pairs_bytes(size, k, torch.float32, coding), dtype=torch.uint8)
    out = torch.zeros(size)
    if op == "pack":
        benchmark(_tagc.pairs_pack, msg, idx, val, size, coding)
    else:
        _tagc.pairs_pack(msg, idx, val, size, coding)
        benchmark(_tagc.pairs_unpack_add, out, msg, k, torch.float32, coding)
        out.zero_()  # the timed calls added into out; one more from zero is checked
    _tagc.pairs_unpack_add(out, msg, k, torch.float32, coding)
    assert torch.equal(out, dense)


@pytest.mark.parametrize("op", ("pack", "unpack"))
@pytest.mark.parametrize("theta", THETAS)
def test_sparse_pairs(benchmark: Callable, size: int, theta: float, op: str) -> None:
    """Mode ``sparse``'s int32-offset pairs: pack, and the owner's scatter-add."""
    import _tagc

    idx, val, dense = _pairs(size, theta)
    k = idx.numel()
    buf = torch.empty(_tagc.sparse_bytes(k, torch.float32), dtype=torch.uint8)
    out = torch.zeros(size)
    if op == "pack":
        benchmark(_tagc.sparse_pack, buf, idx, val)
    else:
        _tagc.sparse_pack(buf, idx, val)
        benchmark(_tagc.sparse_unpack, out, buf, k, torch.float32)
        out.zero_()
    _tagc.sparse_unpack(out, buf, k, torch.float32)
    assert torch.equal(out, dense)


def _sketches(size: int, theta: float) -> Dict[str, object]:
    """RANKS ranks' top-k of different gradients: their summed sketch, union, truth."""
    import _tagc

    k = keep_count(theta, size)
    t = math.ceil(1.3 * min(size, RANKS * k) / 3)
    seed = _tagc.seed_derive(0, 1, 2)
    bitmaps = torch.empty(RANKS, (size + 7) // 8, dtype=torch.uint8)
    total, sk = torch.zeros(3 * t), torch.empty(3 * t)
    truth = torch.zeros(size, dtype=torch.float64)
    idx, val = torch.empty(k, dtype=torch.int32), torch.empty(k)
    for r in range(RANKS):
        _tagc.sparsify(idx, val, bitmaps[r], None, _grad(size, 10 + r), k)
        _tagc.sketch_encode(sk, idx, val, size, t, seed)
        total += sk
        truth.index_add_(0, idx.long(), val.double())
    union = torch.empty((size + 7) // 8, dtype=torch.uint8)
    _tagc.bitmap_or(union, bitmaps, RANKS)
    return dict(t=t, seed=seed, total=total, truth=truth, union=union, idx=idx, val=val, sk=sk)


@pytest.mark.parametrize("op", ("encode", "peel decode"))
@pytest.mark.parametrize("theta", THETAS)
def test_sketch(benchmark: Callable, size: int, theta: float, op: str) -> None:
    """Mode ``exact``: one rank's count sketch, and the owner's peel of the summed ones."""
    import _tagc

    s = _sketches(size, theta)
    t, seed = s["t"], s["seed"]
    if op == "encode":
        sk = torch.empty(3 * t)
        benchmark(_tagc.sketch_encode, sk, s["idx"], s["val"], size, t, seed)
        # a sketch is linear: the last rank's sketch again, bit for bit
        assert torch.equal(sk, s["sk"])
        return
    out = torch.empty(size)
    unpeeled = torch.full((size,), -1, dtype=torch.int32)
    left = benchmark(_tagc.peel_decode, out, s["total"], s["union"], size, t, seed,
                     unpeeled=unpeeled)
    # entries left unpeeled are estimates; every peeled one is the true sum
    peeled = torch.ones(size, dtype=torch.bool)
    if left:
        peeled[unpeeled[:left].long()] = False
    assert left < 0.01 * size
    err = (out.double() - s["truth"])[peeled].abs().max()
    assert err <= 1e-5 * s["truth"].abs().max()


def _quant_reference(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """The block code of ``v`` decoded, in plain torch (DESIGN section 5's scale rules)."""
    b = v.view(-1, BLOCK).double()
    a = b.abs()
    if fmt == "sign":
        s = a.mean(1, keepdim=True)
        return (torch.where(b >= 0, 1.0, -1.0) * s.float().double()).view(-1).float()
    if fmt == "ternary":
        s = torch.minimum(2.5 * a.mean(1, keepdim=True), a.amax(1, keepdim=True))
        lim = 1
    else:
        lim = 7 if fmt == "int4" else 127
        s = a.amax(1, keepdim=True) / lim
    s = s.float()
    q = torch.round(b.float() * (1.0 / s)).clamp(-lim, lim)  # round half to even, as the codec
    return (q * s).view(-1)


@pytest.mark.parametrize("op", ("encode", "decode"))
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quant(benchmark: Callable, size: int, fmt: str, op: str) -> None:
    """Mode ``quant``: encode with fused error feedback, and the owner's decode-add."""
    import _tagc

    n = size - size % BLOCK  # whole blocks, so the reference needs no tail
    grad = _grad(n, 20)
    residual0 = _grad(n, 21) * 0.01
    residual = residual0.clone()
    buf = torch.empty(_tagc.quant_bytes(n, fmt, BLOCK), dtype=torch.uint8)
    out = torch.zeros(n)
    if op == "encode":
        # every timed call feeds the residual back; the checked call starts from residual0
        benchmark(_tagc.quant_encode, buf, residual, grad, fmt, BLOCK)
        residual.copy_(residual0)
        _tagc.quant_encode(buf, residual, grad, fmt, BLOCK)
    else:
        _tagc.quant_encode(buf, residual, grad, fmt, BLOCK)
        benchmark(_tagc.quant_decode_add, out, buf, fmt, BLOCK)
        out.zero_()
    _tagc.quant_decode_add(out, buf, fmt, BLOCK)
    v = grad + residual0
    ref = _quant_reference(v, fmt)
    # the scale's sum of |v| is ordered differently here (float64 either way)
    tol = 1e-6 * v.abs().max().item()
    assert (out - ref).abs().max().item() <= tol
    assert (residual - (v - out)).abs().max().item() <= tol


@pytest.mark.parametrize("op,feedback", (("encode", True), ("encode", False),
                                         ("decode", True)),
                         ids=("encode-fp32-residual", "encode-no-residual", "decode"))
def test_tls(benchmark: Callable, size: int, op: str, feedback: bool) -> None:
    """The sub-1-bit gradient code ``tls`` (ternary under two-level log scales): encode
    with fused error feedback or without (``tagc-lean`` keeps none), and the owner's
    decode-add."""
    import _tagc

    grad = _grad(size, 22)
    residual0 = _grad(size, 23) * 0.01 if feedback else torch.zeros(size)
    residual = residual0.clone() if feedback else None
    buf = torch.empty(_tagc.tls_bytes(size), dtype=torch.uint8)
    out = torch.zeros(size)
    if op == "encode":
        benchmark(_tagc.tls_encode, buf, residual, grad)
        if feedback:
            residual.copy_(residual0)
        _tagc.tls_encode(buf, residual, grad)
    else:
        _tagc.tls_encode(buf, residual, grad)
        benchmark(_tagc.tls_decode_add, out, buf)
        out.zero_()
    _tagc.tls_decode_add(out, buf)
    v = grad + residual0
    if feedback:
        assert (residual - (v - out)).abs().max().item() <= 1e-6 * v.abs().max().item()
    # ternary: each block of 32 decodes to at most the values -s, 0 and s
    whole = out[:size - size % 32].view(-1, 32).abs()
    assert bool((whole == whole.amax(dim=1, keepdim=True)).logical_or(whole == 0).all())
    # and a value is sent only where v has its sign
    assert bool(((out == 0) | (out.sign() == v.sign())).all())


@pytest.mark.parametrize("op", ("encode", "decode"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_wq(benchmark: Callable, size: int, dtype: torch.dtype, op: str) -> None:
    """The weight all-gather's int8 message of one rank (1000 parameter segments)."""
    import _tagc

    gen = torch.Generator().manual_seed(size)
    w = _grad(size, 30).to(dtype)
    cuts = sorted(torch.randint(0, size + 1, (999,), generator=gen).tolist())
    segs = torch.tensor([b - a for a, b in zip([0] + cuts, cuts + [size])], dtype=torch.int64)
    buf = torch.empty(_tagc.wq_bytes(segs, "int8", BLOCK), dtype=torch.uint8)
    out = torch.empty(size, dtype=dtype)
    if op == "encode":
        benchmark(_tagc.wq_encode, buf, w, segs, "int8", BLOCK)
    else:
        _tagc.wq_encode(buf, w, segs, "int8", BLOCK)
        benchmark(_tagc.wq_decode, out, buf, segs, "int8", BLOCK)
    _tagc.wq_decode(out, buf, segs, "int8", BLOCK)
    # every block's scale is at most max|w| / 127: half a step, plus the output's rounding
    step = w.float().abs().max().item() / 127
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = step / 2 * (1 + 1e-6) + ulp * w.float().abs()
    assert bool(((out.float() - w.float()).abs() <= bound).all())


@pytest.mark.parametrize("op", ("encode", "decode"))
def test_wq_delta(benchmark: Callable, size: int, op: str) -> None:
    """``gather_delta``'s int4 message of one rank, a changed shard (1000 segments): the
    owner's compare, code and remember; a receiver's add to the held weights and copy
    into FSDP's slice."""
    import _tagc

    gen = torch.Generator().manual_seed(size)
    w = _grad(size, 31)
    held = w + 1e-3 * _grad(size, 32)
    cuts = sorted(torch.randint(0, size + 1, (999,), generator=gen).tolist())
    segs = torch.tensor([b - a for a, b in zip([0] + cuts, cuts + [size])], dtype=torch.int64)
    buf = torch.empty(_tagc.wq_delta_bytes(segs, "int4", 256), dtype=torch.uint8)
    sent = torch.zeros(size)
    out = torch.empty(size)

    def changed() -> None:
        sent[0] += 1.0  # a shard that differs from the last sent, as every step's first call
        _tagc.wq_delta_encode(buf, w, sent, held, segs, "int4", 256)

    if op == "encode":
        benchmark(changed)
    else:
        changed()
        ref = held.clone()
        benchmark(_tagc.wq_delta_decode, out, ref, buf, segs, "int4", 256)
    assert torch.equal(sent, w) and buf[-1].item() == 1
    change = torch.empty(size)
    _tagc.wq_decode(change, buf[:-1], segs, "int4", 256)
    _tagc.wq_delta_decode(out, held, buf, segs, "int4", 256)
    assert torch.equal(out, held)
    # the change codes w - held to within half an int4 step of its largest block
    assert (held - w).abs().max().item() <= (w - (held - change)).abs().max().item() / 14 * 1.01


@pytest.mark.parametrize("op", ("encode", "decode"))
@pytest.mark.parametrize("rotate", (False, True), ids=("plain", "rotated"))
def test_fp4(benchmark: Callable, size: int, op: str, rotate: bool) -> None:
    """``fp4`` (E2M1 codes, a power-of-two scale per 32 values) with an fp32 residual,
    with or without the seeded block Hadamard rotation: encode, and the decode-add."""
    import _tagc

    grad = _grad(size, 24)
    residual0 = _grad(size, 25) * 0.01
    residual = residual0.clone()
    buf = torch.empty(_tagc.fp4_bytes(size, 32), dtype=torch.uint8)
    out = torch.zeros(size)
    if op == "encode":
        benchmark(_tagc.fp4_encode, buf, residual, grad, 32, seed=3, rotate=rotate)
        residual.copy_(residual0)
        _tagc.fp4_encode(buf, residual, grad, 32, seed=3, rotate=rotate)
    else:
        _tagc.fp4_encode(buf, residual, grad, 32, seed=3, rotate=rotate)
        benchmark(_tagc.fp4_decode_add, out, buf, 32, seed=3, rotate=rotate)
        out.zero_()
    _tagc.fp4_decode_add(out, buf, 32, seed=3, rotate=rotate)
    v = grad + residual0
    # what was not sent stays in the residual; E2M1 keeps about a ninth of |v|'s norm
    assert (residual - (v - out)).abs().max().item() <= 1e-6 * v.abs().max().item()
    assert (out - v).norm().item() <= 0.2 * v.norm().item()


@pytest.mark.parametrize("rotate", (False, True), ids=("plain", "rotated"))
def test_fp4_gather(benchmark: Callable, size: int, rotate: bool) -> None:
    """``fp4`` encode as ``gather: fp4`` runs it: the weights, no residual."""
    import _tagc

    w = _grad(size, 26)
    buf = torch.empty(_tagc.fp4_bytes(size, 32), dtype=torch.uint8)
    benchmark(_tagc.fp4_encode, buf, None, w, 32, seed=3, rotate=rotate)
    out = torch.zeros(size)
    _tagc.fp4_decode_add(out, buf, 32, seed=3, rotate=rotate)
    assert (out - w).norm().item() <= 0.2 * w.norm().item()


def test_memcpy_end(benchmark: Callable, size: int) -> None:
    """The yardstick again, last: with the first, how far the load moved."""
    _memcpy(benchmark, size)
