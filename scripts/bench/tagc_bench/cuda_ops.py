"""Every CUDA codec op of ``_tagc`` against its C twin on the same inputs: a table.

For each op, size and dtype the C op runs on CPU tensors and the op under test on copies
of the same inputs, then every output is compared: bit for bit, and as the largest
absolute difference.  The op under test is ``_tagc`` on CUDA tensors (a side stream,
scalar outputs in device tensors, as the hook calls it) or, without a GPU, the kernels'
own code under the CPU emulation (:class:`tagc_bench.cuda_emu.EmuOps`).

The contract (``cuda/tagc_cuda.h``): selection, sparsification, lanes, bitmaps, pair
packing, block quantization, the tls code, weight quantization and the weights' change
agree bit for bit; sketch buckets and peeled values agree up to fp32 summation order (the
GPU adds with atomics), so those rows pass within that tolerance and say whether they
happened to match bit for bit too.

The input builders and comparisons here are shared with ``tests/test_cuda_ops.py``,
``tests/test_cuda_emulated.py`` (through ``tests/cuda_helpers.py``).

Usage::

    python3 scripts/bench/tagc_bench/cuda_ops.py --target cuda --json ops.json  # on a GPU
    python3 scripts/bench/tagc_bench/cuda_ops.py --target emu --emu-build /tmp/emu  # no GPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import torch

from tagc.codec import _tagc

if not __package__:  # run as a file: the folder holding tagc_bench onto the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the sizes of issue 39 on a GPU (0, 1, odd, 2^24), and what the emulation can run
GPU_SIZES = (0, 1, 100_003, 1 << 24)
EMU_SIZES = (0, 1, 1001, 4099)
DTYPES = (torch.float32, torch.bfloat16)
QFORMATS = ("sign", "ternary", "int4", "int8")
PAIRS_CODINGS = ("ef", "bitmap", "dense")
WQ_FORMATS = ("int8", "int4")
BLOCK = 256


# ----------------------------------------------------------------------------- inputs
def gradient(n: int, dtype: torch.dtype, ties: bool, seed: int) -> torch.Tensor:
    """A gradient-like input of n values (``ties``: few distinct magnitudes, so the k-th
    is shared by many positions).

    Args:
        n: length.
        dtype: its dtype.
        ties: values from {-1.5, -1.25, ..., 1.5} instead of a normal distribution.
        seed: generator seed.
    Returns:
        a CPU tensor.
    """
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-6, 7, (n,), generator=g).float() / 4
    else:
        x = torch.randn(n, generator=g)
    return x.to(dtype)


def kept(n: int, k: int, vd: torch.dtype, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random kept set: k distinct ascending int32 positions below n and values.

    Args:
        n: shard length.
        k: number of kept entries.
        vd: value dtype.
        seed: generator seed.

    Returns:
        (idx, val).
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    return idx, torch.randn(k, generator=g).to(vd)


def bitmap_of(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask into the codec's bitmap (bit p of byte p // 8, LSB first).

    Args:
        mask: 1-D bool tensor of n entries.

    Returns:
        uint8 tensor of ceil(n / 8) bytes, tail bits 0.
    """
    n = mask.numel()
    pad = torch.zeros((n + 7) // 8 * 8, dtype=torch.bool)
    pad[:n] = mask
    return (pad.view(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)


def random_bitmap(n: int, density: float, seed: int) -> torch.Tensor:
    """The bitmap of n random bits, each set with probability ``density``."""
    g = torch.Generator().manual_seed(seed)
    return bitmap_of(torch.rand(n, generator=g) < density)


def two_rank_sketch(ext: ModuleType, n: int, u: int, c: float,
                    sd: torch.dtype) -> Tuple[int, int, torch.Tensor, torch.Tensor]:
    """Two ranks' kept sets encoded by the C op and summed, as the owner gets
    them in `exact` mode.

    Args:
        ext: the imported ``_tagc`` module.
        n: shard length.
        u: size of the union (each rank keeps u // 2).
        c: buckets per union entry (t = ceil(c * u / 3)).
        sd: dtype of the summed sketch.

    Returns:
        (t, seed, sketch of 3 * t entries in sd, bool union mask of n).
    """
    t = max(1, math.ceil(c * u / 3))
    seed = ext.seed_derive(0, 1, 2)
    sk = torch.zeros(3 * t)
    union = torch.zeros(n, dtype=torch.bool)
    for r in range(2):
        idx, val = kept(n, u // 2, torch.float32, seed=100 + r)
        part = torch.empty(3 * t)
        ext.sketch_encode(part, idx, val, n, t, seed)
        sk += part
        union[idx.long()] = True
    return t, seed, sk.to(sd), union


# ----------------------------------------------------------------------------- comparing
def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != 0.0), wherever the tensors live."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(a.dtype)
    if view is not None:
        a, b = a.view(view), b.view(view)
    return torch.equal(a, b)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in float64 (NaN where both are NaN counts as 0, where one is:
    inf; shapes that differ: inf)."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = (a - b).abs()
    d[both_nan] = 0.0
    d[torch.isnan(d)] = math.inf
    return float(d.max())


@dataclass
class Row:
    """One comparison: an op (and variant) at one size and dtype.

    Attributes:
        op: the ``_tagc`` function (``quant_encode int4``: with its variant).
        n: the shard length.
        dtype: the data dtype (``u8`` for ops on bitmaps and lanes only).
        equal: every output the same bits as the C op's.
        max_abs_diff: the largest absolute difference over the outputs.
        contract: ``bits``, or ``fp32 order`` (sketches, peeling: atomics).
        ok: within the contract.
        note: what differed, or why both refused.
        seconds: the time of the row (both sides, inputs included).
    """

    op: str
    n: int
    dtype: str
    equal: bool
    max_abs_diff: float
    contract: str
    ok: bool
    note: str = ""
    seconds: float = 0.0


@contextlib.contextmanager
def side_stream(device: str) -> Iterator[int]:
    """The ``stream=`` handle for ops on ``device``: on CUDA a fresh side stream ordered
    after the current one, joined back and synchronized on exit so the results can be
    read; 0 elsewhere (ignored)."""
    if device != "cuda":
        yield 0
        return
    cur = torch.cuda.current_stream()
    s = torch.cuda.Stream()
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        yield s.cuda_stream
    cur.wait_stream(s)
    torch.cuda.synchronize()


def device_missing(device: str) -> Optional[str]:
    """Why the CUDA ops of ``_tagc`` cannot run on ``device`` here, or None."""
    if _tagc is None:
        return "cannot import _tagc"
    if device == "cuda" and not (torch.cuda.is_available() and _tagc.cuda_available()):
        return "needs a CUDA GPU and _tagc built with CUDA"
    return None


def require_device(prog: str, device: str) -> None:
    """Exit with status 2 and the reason when :func:`device_missing` has one."""
    why = device_missing(device)
    if why:
        print(f"{prog}: {why}", file=sys.stderr)
        sys.exit(2)


class Side:
    """The op under test: ``ops`` (``_tagc`` or an EmuOps) on ``device`` tensors.

    Args:
        ops: the module-like object whose CUDA calling convention is used.
        device: ``"cuda"`` or ``"cpu"`` (the emulation).
    """

    def __init__(self, ops: Any, device: str) -> None:
        self.ops, self.device = ops, device

    def to(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A contiguous copy on the device (None stays None)."""
        return None if t is None else t.to(self.device).contiguous().clone()

    def stream(self) -> ContextManager[int]:
        """:func:`side_stream` of the device."""
        return side_stream(self.device)


class Outcome(NamedTuple):
    """One op's comparison: ``equal`` (every output the same bits), ``diff`` (largest
    absolute difference), ``note`` (what differed, or why both refused), ``ok`` (within
    the op's contract)."""

    equal: bool
    diff: float
    note: str
    ok: bool


def compare(pairs: Sequence[Tuple[str, torch.Tensor, torch.Tensor]]) -> Outcome:
    """Bits and largest difference over several named outputs (got, want); ok when every
    output has the same bits."""
    bad = [name for name, got, want in pairs if not same_bits(got, want)]
    diff = max((max_abs_diff(got, want) for _, got, want in pairs), default=0.0)
    return Outcome(not bad, diff, ("differs: " + ", ".join(bad)) if bad else "", not bad)


def pair(c_call: Callable[[], Any], d_call: Callable[[], Any],
         outputs: Callable[[], Sequence[Tuple[str, torch.Tensor, torch.Tensor]]]) -> Outcome:
    """Run the C op, then the op under test on the same inputs, and compare ``outputs()``
    (named (got, want) pairs).  When the C op refuses its arguments the op under test
    must refuse them too (and then the row is equal); when only the op under test
    refuses, or raises, the row fails."""
    try:
        c_call()
    except Exception as c_exc:  # noqa: BLE001 - any refusal must be matched
        try:
            d_call()
        except Exception as d_exc:  # noqa: BLE001
            note = f"both refuse: {type(c_exc).__name__}: {c_exc}"[:200]
            if type(d_exc) is not type(c_exc):
                note += f" (op under test: {type(d_exc).__name__})"
            return Outcome(True, 0.0, note, True)
        return Outcome(False, math.inf, f"the C op refuses ({c_exc}), the op under test "
                       "does not"[:200], False)
    try:
        d_call()
    except Exception as d_exc:  # noqa: BLE001
        return Outcome(False, math.inf, f"the op under test raises {type(d_exc).__name__}: "
                       f"{d_exc}"[:200], False)
    return compare(outputs())


def scalar_op(side: Side, c_fn: Callable[[], Any], d_fn: Callable[[torch.Tensor, int], None],
              dtype: torch.dtype) -> Outcome:
    """An op with a scalar result: the C op returns it, the op under test writes it into a
    1-element device tensor of ``dtype`` (``d_fn(out, stream)``)."""
    out = torch.full((1,), -1, dtype=dtype, device=side.device)
    want: Dict[str, Any] = {}

    def c_call() -> None:
        want["v"] = c_fn()

    def d_call() -> None:
        with side.stream() as s:
            d_fn(out, s)

    return pair(c_call, d_call, lambda: [("scalar", out, torch.tensor([want["v"]], dtype=dtype))])


def kth(n: int) -> int:
    """The kept count of the bench's theta 0.9875: ceil(n / 80), 0 for n = 0."""
    return -(-n // 80)


# ----------------------------------------------------------------------------- the ops
def check_select_kth(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    k = kth(n)
    x = gradient(n, dt, False, seed=n + 1)
    d_x = side.to(x)
    return {"select_kth": scalar_op(
        side, lambda: _tagc.select_kth(x, k),
        lambda out, s: side.ops.select_kth(d_x, k, out=out, stream=s), torch.float32)}


def check_sparsify(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    k, nb = kth(n), (n + 7) // 8
    g = gradient(n, dt, False, seed=3 * n + 1)
    r = (gradient(n, torch.float32, False, seed=n) / 8).to(dt)
    c = dict(idx=torch.full((k,), -7, dtype=torch.int32), val=torch.full((k,), 9.0, dtype=dt),
             bm=torch.full((nb,), 0xA5, dtype=torch.uint8), res=r.clone())
    d = {name: side.to(t) for name, t in c.items()}
    tau = torch.zeros(1, device=side.device)
    want: Dict[str, float] = {}

    def c_call() -> None:
        want["tau"] = _tagc.sparsify(c["idx"], c["val"], c["bm"], c["res"], g, k)

    def d_call() -> None:
        with side.stream() as s:
            side.ops.sparsify(d["idx"], d["val"], d["bm"], d["res"], side.to(g), k, out=tau,
                              stream=s)

    return {"sparsify": pair(c_call, d_call, lambda: [
        ("tau", tau, torch.tensor([want["tau"]], dtype=torch.float32))]
        + [(name, d[name], c[name]) for name in ("idx", "val", "bm", "res")])}


def check_lanes_bitmaps(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    """lanes_pack (4-bit lanes of 3 bitmaps), lanes_unpack (of their byte-wise sum, carries
    and wrap-around included), bitmap_or (4 bitmaps), popcount (tail bits set)."""
    bits, nb = 4, (n + 7) // 8
    nl = (n * bits + 7) // 8
    bms = [random_bitmap(n, 0.3, seed=n + s) for s in range(4)]
    out: Dict[str, Outcome] = {}
    c_lanes = [torch.zeros(nl, dtype=torch.uint8) for _ in range(3)]
    d_lanes = [side.to(cl) for cl in c_lanes]

    def c_pack() -> None:
        for b, cl in zip(bms, c_lanes):
            _tagc.lanes_pack(cl, b, n, bits)

    def d_pack() -> None:
        with side.stream() as s:
            for b, dl in zip(bms, d_lanes):
                side.ops.lanes_pack(dl, side.to(b), n, bits, stream=s)

    out["lanes_pack 4-bit"] = pair(c_pack, d_pack, lambda: [
        (f"lanes{i}", dl, cl) for i, (dl, cl) in enumerate(zip(d_lanes, c_lanes))])
    summed = (sum(cl.long() for cl in c_lanes) % 256).to(torch.uint8)
    c_bm = torch.full((nb,), 0x5A, dtype=torch.uint8)
    d_bm = side.to(c_bm)

    def c_unpack() -> None:
        _tagc.lanes_unpack(c_bm, summed, n, bits)

    def d_unpack() -> None:
        with side.stream() as s:
            side.ops.lanes_unpack(d_bm, side.to(summed), n, bits, stream=s)

    out["lanes_unpack 4-bit"] = pair(c_unpack, d_unpack, lambda: [("bitmap", d_bm, c_bm)])
    src = torch.cat(bms)
    c_or = torch.full((nb,), 0x33, dtype=torch.uint8)
    d_or = side.to(c_or)

    def c_or_call() -> None:
        _tagc.bitmap_or(c_or, src, 4)

    def d_or_call() -> None:
        with side.stream() as s:
            side.ops.bitmap_or(d_or, side.to(src), 4, stream=s)

    out["bitmap_or x4"] = pair(c_or_call, d_or_call, lambda: [("dst", d_or, c_or)])
    raw = torch.randint(0, 256, (nb,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(n))  # tail bits set too
    d_raw = side.to(raw)
    out["popcount"] = scalar_op(side, lambda: _tagc.popcount(raw, n),
                                lambda cnt, s: side.ops.popcount(d_raw, n, out=cnt, stream=s),
                                torch.int64)
    return out


def _order_contract(got: Outcome, within: bool, what: str) -> Outcome:
    """An fp32-order op's outcome: ok when within its tolerance, bits or not."""
    if got.equal or not math.isfinite(got.diff) and got.note.startswith("the "):
        return got
    return got._replace(ok=within, note=got.note if within else f"{got.note}; {what}")


def check_sketch_encode(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    k = kth(n)
    t = max(1, math.ceil(1.3 * k / 3))
    idx, val = kept(n, k, dt, seed=k + 7)
    seed = _tagc.seed_derive(7, 3, 11)
    c_sk = torch.full((3 * t,), 5.0, dtype=dt)
    d_sk = side.to(c_sk)

    def c_call() -> None:
        _tagc.sketch_encode(c_sk, idx, val, n, t, seed)

    def d_call() -> None:
        with side.stream() as s:
            side.ops.sketch_encode(d_sk, side.to(idx), side.to(val), n, t, seed, stream=s)

    got = pair(c_call, d_call, lambda: [("sketch", d_sk, c_sk)])
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    within = bool(torch.allclose(d_sk.cpu().float(), c_sk.float(), **tol))
    return {"sketch_encode": _order_contract(got, within, "outside the fp32-order tolerance")}


def _peel_close(got: torch.Tensor, want: torch.Tensor, sd: torch.dtype) -> bool:
    """Peeled values up to rounding (tests/test_cuda_ops.py's rule): fp32 sketches to 1e-4;
    bf16 ones round each bucket differently and the difference travels down peeling
    chains, so almost every value to bf16 precision and all bounded."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if sd == torch.float32:
        return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    diff = (got - want).abs()
    return diff.numel() == 0 or (float((diff > 0.03).float().mean()) < 0.01
                                 and float(diff.max()) < 0.5)


def check_peel_decode(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    u = min(n, 2 * kth(n))
    t, seed, sk, union = two_rank_sketch(_tagc, n, u, 1.3, dt)
    bm = bitmap_of(union)
    usize = int(union.sum())
    c_out = torch.full((n,), 3.0)
    c_unp = torch.full((usize + 1,), -1, dtype=torch.int32)
    d_out, d_unp = side.to(c_out), side.to(c_unp)
    cnt = torch.full((1,), -1, dtype=torch.int64, device=side.device)
    want: Dict[str, int] = {}

    def c_call() -> None:
        want["cnt"] = _tagc.peel_decode(c_out, sk, bm, n, t, seed, unpeeled=c_unp, estimate=True)

    def d_call() -> None:
        with side.stream() as s:
            side.ops.peel_decode(d_out, side.to(sk), side.to(bm), n, t, seed, unpeeled=d_unp,
                                 estimate=True, count_out=cnt, stream=s)

    got = pair(c_call, d_call, lambda: [("count", cnt, torch.tensor([want["cnt"]])),
                                        ("unpeeled", d_unp, c_unp), ("out", d_out, c_out)])
    same_set = "cnt" in want and same_bits(cnt, torch.tensor([want["cnt"]])) \
        and same_bits(d_unp, c_unp)
    within = same_set and _peel_close(d_out, c_out, dt)
    return {"peel_decode": _order_contract(
        got, within, "the unpeeled set differs" if not same_set
        else "values outside the fp32-order tolerance")}


def check_sparse(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    k = kth(n)
    idx, val = kept(n, k, dt, seed=k + 1)
    nbytes = k * (4 + torch.empty(0, dtype=dt).element_size())
    c_buf = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
    d_buf = side.to(c_buf)
    out: Dict[str, Outcome] = {}

    def c_pack() -> None:
        _tagc.sparse_pack(c_buf, idx, val)

    def d_pack() -> None:
        with side.stream() as s:
            side.ops.sparse_pack(d_buf, side.to(idx), side.to(val), stream=s)

    out["sparse_pack"] = pair(c_pack, d_pack, lambda: [("buf", d_buf, c_buf)])
    base = gradient(n, torch.float32, False, seed=9)
    c_out, d_out = base.clone(), side.to(base)

    def c_unpack() -> None:
        _tagc.sparse_unpack(c_out, c_buf, k, dt)

    def d_unpack() -> None:
        with side.stream() as s:
            side.ops.sparse_unpack(d_out, side.to(c_buf), k, dt, stream=s)

    out["sparse_unpack"] = pair(c_unpack, d_unpack, lambda: [("out", d_out, c_out)])
    return out


def _encode_decode(side: Side, name: str, c_enc: Callable[[torch.Tensor], None],
                   d_enc: Callable[[torch.Tensor, int], None], nbytes: int,
                   encoded: Sequence[Tuple[str, torch.Tensor, torch.Tensor]],
                   c_dec: Callable[[torch.Tensor], None],
                   d_dec: Callable[[torch.Tensor, int], None],
                   decoded: Tuple[torch.Tensor, torch.Tensor]) -> Dict[str, Outcome]:
    """An encoder and its decoder: the encoder's bytes (and ``encoded``, its other outputs:
    (name, under test, C)) against the C op's, then both decoders on the C op's bytes
    into ``decoded`` (under test, C).  ``name`` is "<encoder>/<decoder> <variant>"."""
    enc, rest = name.split("/", 1)
    dec, variant = rest.split(" ", 1)
    c_buf = torch.zeros(nbytes, dtype=torch.uint8)
    d_buf = side.to(torch.full((nbytes,), 0xEE, dtype=torch.uint8))

    def run_d(fn: Callable[[torch.Tensor, int], None], buf: torch.Tensor) -> Callable[[], None]:
        def call() -> None:
            with side.stream() as s:
                fn(buf, s)
        return call

    out = {f"{enc} {variant}": pair(lambda: c_enc(c_buf), run_d(d_enc, d_buf),
                                    lambda: [("buf", d_buf, c_buf), *encoded])}
    d_out, c_out = decoded
    out[f"{dec} {variant}"] = pair(lambda: c_dec(c_buf), run_d(d_dec, side.to(c_buf)),
                                   lambda: [("out", d_out, c_out)])
    return out


def check_quant(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    out: Dict[str, Outcome] = {}
    grad = gradient(n, dt, False, seed=n)
    res = (gradient(n, torch.float32, False, seed=n + 1) * 0.3).to(dt)
    base = gradient(n, torch.float32, False, seed=n + 2)
    d_grad = side.to(grad)
    for fmt in QFORMATS:
        c_res, d_res = res.clone(), side.to(res)
        c_out, d_out = base.clone(), side.to(base)
        out.update(_encode_decode(
            side, f"quant_encode/quant_decode_add {fmt}",
            lambda buf: _tagc.quant_encode(buf, c_res, grad, fmt, BLOCK),
            lambda buf, s: side.ops.quant_encode(buf, d_res, d_grad, fmt, BLOCK, stream=s),
            _tagc.quant_bytes(n, fmt, BLOCK), [("residual", d_res, c_res)],
            lambda buf: _tagc.quant_decode_add(c_out, buf, fmt, BLOCK),
            lambda buf, s: side.ops.quant_decode_add(d_out, buf, fmt, BLOCK, stream=s),
            (d_out, c_out)))
    return out


def tls_gradient(n: int, dt: torch.dtype, seed: int) -> torch.Tensor:
    """A gradient whose scales vary as the tls code's two levels do: each group of 512
    values under a scale in 2^-16..2^0 (many group codes), each of its blocks of 32 under
    a further 2^-5..2^0 (past the block codes' 14/3 octaves, so some clamp), the second
    block and the third group all zero (codes 15 and 255).  Normal values under one scale
    would use a few codes only.

    Args:
        n: length.
        dt: its dtype.
        seed: generator seed.
    Returns:
        a CPU tensor.
    """
    g = torch.Generator().manual_seed(seed)
    nb = (n + 31) // 32
    octave = (-16 * torch.rand((nb + 15) // 16, generator=g)).repeat_interleave(16)[:nb]
    scale = torch.exp2(octave - 5 * torch.rand(nb, generator=g))
    scale[1:2] = 0.0  # slices: a short shard has fewer blocks
    scale[32:48] = 0.0
    x = torch.randn(n, generator=g) * scale.repeat_interleave(32)[:n]
    return x.to(dt)


def check_tls(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    """The tls code with error feedback (a residual in ``dt``, updated in place) and
    without, each message decoded."""
    out: Dict[str, Outcome] = {}
    grad = tls_gradient(n, dt, seed=n + 11)
    res = (tls_gradient(n, torch.float32, seed=n + 12) * 0.3).to(dt)
    base = gradient(n, torch.float32, False, seed=n + 13)
    d_grad = side.to(grad)
    for variant, r in (("residual", res), ("no-residual", None)):
        c_res, d_res = (None if r is None else r.clone()), side.to(r)
        c_out, d_out = base.clone(), side.to(base)
        out.update(_encode_decode(
            side, f"tls_encode/tls_decode_add {variant}",
            lambda buf: _tagc.tls_encode(buf, c_res, grad),
            lambda buf, s: side.ops.tls_encode(buf, d_res, d_grad, stream=s),
            _tagc.tls_bytes(n), [] if r is None else [("residual", d_res, c_res)],
            lambda buf: _tagc.tls_decode_add(c_out, buf),
            lambda buf, s: side.ops.tls_decode_add(d_out, buf, stream=s),
            (d_out, c_out)))
    return out


def check_pairs(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    out: Dict[str, Outcome] = {}
    k = kth(n)
    idx, val = kept(n, k, dt, seed=n + k)
    d_idx, d_val = side.to(idx), side.to(val)
    base = gradient(n, torch.float32, False, seed=k)
    for coding in PAIRS_CODINGS:
        c_out, d_out = base.clone(), side.to(base)
        out.update(_encode_decode(
            side, f"pairs_pack/pairs_unpack_add {coding}",
            lambda buf: _tagc.pairs_pack(buf, idx, val, n, coding),
            lambda buf, s: side.ops.pairs_pack(buf, d_idx, d_val, n, coding, stream=s),
            _tagc.pairs_bytes(n, k, dt, coding), [],
            lambda buf: _tagc.pairs_unpack_add(c_out, buf, k, dt, coding),
            lambda buf, s: side.ops.pairs_unpack_add(d_out, buf, k, dt, coding, stream=s),
            (d_out, c_out)))
    return out


def check_wq(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    out: Dict[str, Outcome] = {}
    segs = torch.tensor([n // 3, 0, n - n // 3], dtype=torch.int64)
    d_segs = side.to(segs)
    x = gradient(n, dt, False, seed=n + 5)
    d_x = side.to(x)
    for fmt in WQ_FORMATS:
        c_out = torch.full((n,), 3.0, dtype=dt)
        d_out = side.to(c_out)
        out.update(_encode_decode(
            side, f"wq_encode/wq_decode {fmt}",
            lambda buf: _tagc.wq_encode(buf, x, segs, fmt, BLOCK),
            lambda buf, s: side.ops.wq_encode(buf, d_x, d_segs, fmt, BLOCK, stream=s),
            _tagc.wq_bytes(segs, fmt, BLOCK), [],
            lambda buf: _tagc.wq_decode(c_out, buf, segs, fmt, BLOCK),
            lambda buf, s: side.ops.wq_decode(d_out, buf, d_segs, fmt, BLOCK, stream=s),
            (d_out, c_out)))
    return out


def check_wq_delta(side: Side, n: int, dt: torch.dtype) -> Dict[str, Outcome]:
    """The weights' change, both messages of a step: a changed shard (the codes of
    ``src - base``, ``sent`` updated; decoded into ``ref`` and ``out``), then the same
    shard again (all zeros; ``out = ref``)."""
    out: Dict[str, Outcome] = {}
    segs = torch.tensor([n // 3, 0, n - n // 3], dtype=torch.int64)
    d_segs = side.to(segs)
    src = gradient(n, dt, False, seed=n + 7)
    base = (src.float() + gradient(n, torch.float32, False, seed=n + 8) / 64).to(dt)
    d_src, d_base = side.to(src), side.to(base)
    for fmt in WQ_FORMATS:
        nb = _tagc.wq_delta_bytes(segs, fmt, BLOCK)
        c_sent, c_ref, c_out = base.clone(), base.clone(), torch.full((n,), 3.0, dtype=dt)
        d_sent, d_ref, d_out = side.to(c_sent), side.to(c_ref), side.to(c_out)
        for step in ("changed", "unchanged"):
            c_buf = torch.full((nb,), 0xEE, dtype=torch.uint8)
            d_buf = side.to(c_buf)

            def c_enc(c_buf: torch.Tensor = c_buf) -> None:
                _tagc.wq_delta_encode(c_buf, src, c_sent, base, segs, fmt, BLOCK)

            def d_enc(d_buf: torch.Tensor = d_buf) -> None:
                with side.stream() as st:
                    side.ops.wq_delta_encode(d_buf, d_src, d_sent, d_base, d_segs, fmt, BLOCK,
                                             stream=st)

            out[f"wq_delta_encode {fmt}-{step}"] = pair(
                c_enc, d_enc, lambda c_buf=c_buf, d_buf=d_buf: [
                    ("buf", d_buf, c_buf), ("sent", d_sent, c_sent)])

            def c_dec(c_buf: torch.Tensor = c_buf) -> None:
                _tagc.wq_delta_decode(c_out, c_ref, c_buf, segs, fmt, BLOCK)

            def d_dec(c_buf: torch.Tensor = c_buf) -> None:
                with side.stream() as st:
                    side.ops.wq_delta_decode(d_out, d_ref, side.to(c_buf), d_segs, fmt, BLOCK,
                                             stream=st)

            out[f"wq_delta_decode {fmt}-{step}"] = pair(
                c_dec, d_dec, lambda: [("out", d_out, c_out), ("ref", d_ref, c_ref)])
    return out


# (check, whether its data has a dtype: ops on bitmaps run once per size, dtype "u8")
CHECKS: List[Tuple[Callable[[Side, int, torch.dtype], Dict[str, Outcome]], bool]] = [
    (check_select_kth, True), (check_sparsify, True), (check_lanes_bitmaps, False),
    (check_sketch_encode, True), (check_peel_decode, True), (check_sparse, True),
    (check_quant, True), (check_tls, True), (check_pairs, True), (check_wq, True),
    (check_wq_delta, True),
]
# the ops whose contract is fp32 summation order, not bits
ORDER_CONTRACT = ("sketch_encode", "peel_decode")


def run_all(side: Side, sizes: Sequence[int],
            log: Optional[Callable[[str], None]] = None) -> List[Row]:
    """Every check at every size and dtype.

    Args:
        side: the op under test.
        sizes: shard lengths.
        log: called with one line per (check, size, dtype) done.
    Returns:
        the rows; a check that raised gives one failed row naming the exception.
    """
    rows: List[Row] = []
    for n in sizes:
        for check, typed in CHECKS:
            for dt in (DTYPES if typed else DTYPES[:1]):
                dname = str(dt).replace("torch.", "") if typed else "u8"
                t0 = time.perf_counter()
                try:
                    got = check(side, n, dt)
                except Exception as exc:  # noqa: BLE001 - a crash is a failed row, not the end
                    got = {check.__name__[len("check_"):]: Outcome(
                        False, math.inf, f"raised {type(exc).__name__}: {exc}"[:300], False)}
                secs = (time.perf_counter() - t0) / max(len(got), 1)
                for op, o in got.items():
                    order = op.split()[0] in ORDER_CONTRACT
                    rows.append(Row(op, n, dname, o.equal, o.diff,
                                    "fp32 order" if order else "bits", o.ok, o.note, secs))
                if log:
                    log(f"{check.__name__} n={n} {dname}: "
                        + ", ".join(f"{op}={'ok' if r.ok else 'FAIL'}"
                                    for op, r in zip(got, rows[-len(got):])))
    return rows


def markdown(rows: List[Row]) -> str:
    """The table: op, size, dtype, equal?, max abs diff, contract, status, note."""
    lines = ["| op | n | dtype | bit-equal | max abs diff | contract | status | note |",
             "|---|---:|---|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.n} | {r.dtype} | {'yes' if r.equal else 'no'} | "
                     f"{r.max_abs_diff:.3g} | {r.contract} | {'ok' if r.ok else '**FAIL**'} | "
                     f"{r.note.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Command line: run the table on the GPU or under the emulation.

    Returns:
        0 when every row is within its contract, 1 otherwise, 2 when the target is
        missing (no GPU, no CUDA build, no emulated library).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=("cuda", "emu"), default="cuda")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated shard lengths (default: 0,1,100003,2^24 on CUDA; "
                         "0,1,1001,4099 under the emulation)")
    ap.add_argument("--emu-lib", default=None, help="the emulated library (cuda_emu.build)")
    ap.add_argument("--emu-build", default=None, help="build the emulated library here first")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    require_device("cuda_ops", "cuda" if args.target == "cuda" else "cpu")
    if args.target == "cuda":
        side, sizes = Side(_tagc, "cuda"), GPU_SIZES
    else:
        from tagc_bench import cuda_emu

        lib = args.emu_lib or (args.emu_build and cuda_emu.build(args.emu_build))
        if not lib:
            print("cuda_ops: --target emu needs --emu-lib or --emu-build", file=sys.stderr)
            return 2
        side, sizes = Side(cuda_emu.EmuOps(lib), "cpu"), EMU_SIZES
    if args.sizes:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    t0 = time.perf_counter()
    rows = run_all(side, sizes, log=lambda line: print(line, flush=True))
    print(markdown(rows))
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows)} rows, {sum(r.equal for r in rows)} bit-equal, {len(bad)} outside "
          f"their contract ({time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "sizes": list(sizes), "_tagc": _tagc.__file__,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
