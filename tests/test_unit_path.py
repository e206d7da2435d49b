"""The unit path: the quant transport with a coded residual in one call per side.

``_tagc.quant_unit_encode`` / ``quant_unit_decode`` (csrc/quant.c) against the calls they
replace, one after another (decode the residual into zeros, reset it when not finite,
scale it, encode every other shard with it, code it back; zero a sum, decode-add every
message, add the own shard, divide, cast), bit for bit; their CUDA twins
(cuda/quant_unit.cu) under the emulation against the C op; and the reducer on the unit
path against the same reducer on the general path (``UnitReducer.UNIT_PATH = False``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, List, Optional, Tuple

import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

import tagc_hook as tagc
from tagc.device import CodecStreams
from tagc.reducer import UnitReducer
from tagc.selection import UnitSpec

FORMATS = ["sign", "ternary", "int4", "int8"]


def coded(values: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``values`` as block codes (a residual as the reducer keeps it)."""
    codes = torch.empty(_tagc.quant_bytes(values.numel(), fmt, block), dtype=torch.uint8)
    _tagc.quant_encode(codes, None, values, fmt, block)
    return codes


def encode_ref(grad: torch.Tensor, codes: torch.Tensor, world: int, rank: int, fmt: str,
               rfmt: str, block: int, factor: float) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """What the general path does: messages, new residual codes, whether it reset."""
    n, s = grad.numel(), grad.numel() // world
    w = torch.zeros(n)
    _tagc.quant_decode_add(w, codes, rfmt, block)
    reset = 0
    if not torch.isfinite(w).all():
        w.zero_()
        reset = 1
    if factor != 1.0:
        w.mul_(factor)
    buf = torch.zeros(world, _tagc.quant_bytes(s, fmt, block), dtype=torch.uint8)
    for r in range(world):
        if r != rank:
            _tagc.quant_encode(buf[r], w[r * s:(r + 1) * s], grad[r * s:(r + 1) * s], fmt, block)
    new = torch.empty_like(codes)
    _tagc.quant_encode(new, None, w, rfmt, block)
    return buf, new, reset


def decode_ref(buf: torch.Tensor, own: torch.Tensor, world: int, rank: int, fmt: str,
               block: int, divisor: float, dtype: torch.dtype) -> torch.Tensor:
    acc = torch.zeros(own.numel())
    for r in range(world):
        if r == rank:
            acc.add_(own)
        else:
            _tagc.quant_decode_add(acc, buf[r], fmt, block)
    if divisor != 1:
        acc.div_(divisor)
    return acc.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def case(world: int, blocks: int, block: int, dtype: torch.dtype, rfmt: str, seed: int
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = world * blocks * block
    grad = torch.randn(n, generator=g).to(dtype)
    return grad, coded(torch.randn(n, generator=g) * 0.1, rfmt, block)


CASES = [  # world, blocks per shard, block, formats, grad dtype, factor
    (2, 1, 64, "int4", "int4", torch.float32, 0.5),
    (2, 33, 64, "int4", "int4", torch.bfloat16, 0.5),
    (3, 7, 32, "int8", "int4", torch.bfloat16, 0.3),
    (4, 5, 16, "ternary", "int8", torch.float32, 1.0),
    (2, 3, 8, "sign", "int4", torch.bfloat16, 0.0),
    (5, 9, 1, "int4", "int8", torch.float32, 0.7),
    (1, 4, 64, "int4", "int4", torch.float32, 0.5),
    (2, 0, 64, "int4", "int4", torch.float32, 0.5),
]


@pytest.mark.parametrize("world,blocks,block,fmt,rfmt,dtype,factor", CASES)
def test_encode_and_decode_equal_the_general_calls(world: int, blocks: int, block: int,
                                                   fmt: str, rfmt: str, dtype: torch.dtype,
                                                   factor: float) -> None:
    for rank in range(world):
        grad, codes = case(world, blocks, block, dtype, rfmt, seed=17 * world + rank)
        want_buf, want_codes, want_reset = encode_ref(grad, codes, world, rank, fmt, rfmt,
                                                      block, factor)
        buf = torch.full_like(want_buf, 0xEE)
        got = codes.clone()
        reset = _tagc.quant_unit_encode(buf, got, grad, world, rank, fmt, rfmt, block, factor)
        others = [r for r in range(world) if r != rank]
        assert torch.equal(buf[others], want_buf[others])
        assert (buf[rank] == 0xEE).all()  # the own row is not written
        assert torch.equal(got, want_codes) and reset == want_reset == 0
        s = grad.numel() // world
        own = grad[rank * s:(rank + 1) * s]
        for out_dtype in (torch.float32, torch.bfloat16):
            for divisor in (1.0, 2.0, 3.0):
                out = torch.empty(s, dtype=out_dtype)
                _tagc.quant_unit_decode(out, want_buf, own, world, rank, fmt, block, divisor)
                assert same(out, decode_ref(want_buf, own, world, rank, fmt, block, divisor,
                                            out_dtype))


@pytest.mark.slow
def test_large_unit() -> None:
    """2^22 values per shard (a GPT-2 124M block's largest shards are about 2^22)."""
    grad, codes = case(2, 1 << 16, 64, torch.float32, "int4", seed=5)
    want_buf, want_codes, _ = encode_ref(grad, codes, 2, 1, "int4", "int4", 64, 0.5)
    buf = torch.empty_like(want_buf)
    _tagc.quant_unit_encode(buf, codes, grad, 2, 1, "int4", "int4", 64, 0.5)
    assert torch.equal(buf[0], want_buf[0]) and torch.equal(codes, want_codes)


def test_nonfinite_residual_is_reset() -> None:
    grad, codes = case(2, 4, 64, torch.float32, "int4", seed=1)
    rec = _tagc.quant_bytes(64, "int4", 64)
    codes[2 * rec:2 * rec + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # NaN
    want_buf, want_codes, want_reset = encode_ref(grad, codes, 2, 0, "int4", "int4", 64, 0.5)
    buf = torch.empty_like(want_buf)
    assert _tagc.quant_unit_encode(buf, codes, grad, 2, 0, "int4", "int4", 64, 0.5) == 1
    assert want_reset == 1
    assert torch.equal(buf[1], want_buf[1]) and torch.equal(codes, want_codes)


def test_huge_scale_that_overflows_is_reset_only_when_a_product_does() -> None:
    """A finite scale above FLT_MAX / 127 resets only when a code times it overflows."""
    n = 128
    codes = coded(torch.zeros(n), "int8", 64)
    big = torch.tensor([3e38], dtype=torch.float32).view(torch.uint8)
    codes[:4] = big  # record 0: every code 0, so every product is 0
    grad = torch.randn(n)
    buf = torch.empty(2, _tagc.quant_bytes(64, "int8", 64), dtype=torch.uint8)
    assert _tagc.quant_unit_encode(buf, codes.clone(), grad, 2, 0, "int8", "int8", 64, 1.0) == 0
    codes[4] = 1  # q = 1: 3e38 is finite
    assert _tagc.quant_unit_encode(buf, codes.clone(), grad, 2, 0, "int8", "int8", 64, 1.0) == 0
    codes[4] = 100  # q = 100: overflows
    assert _tagc.quant_unit_encode(buf, codes.clone(), grad, 2, 0, "int8", "int8", 64, 1.0) == 1


def test_data_errors_leave_the_residual_untouched() -> None:
    grad, codes = case(2, 4, 64, torch.float32, "int4", seed=2)
    buf = torch.empty(2, _tagc.quant_bytes(256, "int4", 64), dtype=torch.uint8)
    bad = grad.clone()
    bad[300] = float("inf")  # in shard 1, which rank 0 sends
    kept = codes.clone()
    with pytest.raises(_tagc.NonFiniteError, match="rcodes untouched"):
        _tagc.quant_unit_encode(buf, codes, bad, 2, 0, "int4", "int4", 64, 0.5)
    assert torch.equal(codes, kept)
    bad = grad.clone()
    bad[3] = float("nan")  # the own shard is not sent: no error
    _tagc.quant_unit_encode(buf, codes, bad, 2, 0, "int4", "int4", 64, 0.5)
    codes = kept.clone()
    codes[4 + 36] = 0xFF  # nibble 15 in record 1
    corrupt = codes.clone()
    with pytest.raises(ValueError, match="outside residual_format"):
        _tagc.quant_unit_encode(buf, codes, grad, 2, 0, "int4", "int4", 64, 0.5)
    assert torch.equal(codes, corrupt)
    msg = torch.zeros_like(buf)
    msg[1, 4] = 0xFF
    out = torch.full((256,), 7.0)
    with pytest.raises(ValueError, match="out untouched"):
        _tagc.quant_unit_decode(out, msg, grad[:256], 2, 0, "int4", 64, 1.0)
    assert (out == 7.0).all()


def test_bad_arguments_raise() -> None:
    grad, codes = case(2, 2, 64, torch.float32, "int4", seed=3)
    buf = torch.empty(2, _tagc.quant_bytes(128, "int4", 64), dtype=torch.uint8)
    args = (buf, codes, grad, 2, 0, "int4", "int4", 64, 0.5)

    def enc(i: int, v: object) -> None:
        a = list(args)
        a[i] = v
        _tagc.quant_unit_encode(*a)

    with pytest.raises(ValueError, match="world"):
        enc(3, 0)
    with pytest.raises(ValueError, match="rank"):
        enc(4, 2)
    with pytest.raises(ValueError, match="do not split"):
        enc(3, 3)
    with pytest.raises(ValueError, match="whole number of blocks"):
        enc(7, 48)
    with pytest.raises(ValueError, match="factor"):
        enc(8, 1.5)
    with pytest.raises(ValueError, match="factor"):
        enc(8, float("nan"))
    with pytest.raises(ValueError, match="format"):
        enc(5, "int3")
    with pytest.raises(ValueError, match="residual_format"):
        enc(6, "fp4")
    with pytest.raises(ValueError, match="buf"):
        enc(0, buf.view(-1)[:-1])
    with pytest.raises(ValueError, match="rcodes"):
        enc(1, torch.cat([codes, codes[:1]]))
    with pytest.raises(TypeError, match="grad"):
        enc(2, grad.double())
    with pytest.raises(TypeError, match="rcodes"):
        enc(1, codes.to(torch.int32))
    for cuda_only in ({"counts": torch.zeros(5, dtype=torch.int64)},
                      {"vote": torch.zeros(1)},
                      {"flags": torch.zeros(2, dtype=torch.int32)}):
        with pytest.raises(ValueError, match="for CUDA tensors"):
            _tagc.quant_unit_encode(*args, **cuda_only)
    with pytest.raises(ValueError, match="counts"):
        _tagc.quant_unit_encode(*args, counts=torch.zeros(2, dtype=torch.int64))
    out = torch.empty(128)
    with pytest.raises(ValueError, match="divisor"):
        _tagc.quant_unit_decode(out, buf, grad[:128], 2, 0, "int4", 64, 0.0)
    with pytest.raises(ValueError, match="own"):
        _tagc.quant_unit_decode(out, buf, grad[:127], 2, 0, "int4", 64, 1.0)
    with pytest.raises(ValueError, match="buf"):
        _tagc.quant_unit_decode(out, buf[:1], grad[:128], 2, 0, "int4", 64, 1.0)
    with pytest.raises(ValueError, match="rank"):
        _tagc.quant_unit_decode(out, buf, grad[:128], 2, 2, "int4", 64, 1.0)
    with pytest.raises(TypeError, match="out"):
        _tagc.quant_unit_decode(out.double(), buf, grad[:128], 2, 0, "int4", 64, 1.0)


# --------------------------------------------------------------- the CUDA twin, emulated
@pytest.fixture(scope="module")
def emu(cuda_emu_library: Path):
    from tagc_bench import cuda_emu
    return cuda_emu.EmuOps(cuda_emu_library)


@pytest.mark.slow
@pytest.mark.parametrize("world,blocks,block,fmt,rfmt,dtype,factor", CASES[:6] + CASES[7:])
def test_cuda_twin_writes_the_c_bytes(emu, world: int, blocks: int, block: int, fmt: str,
                                      rfmt: str, dtype: torch.dtype, factor: float) -> None:
    """Bit for bit the C op's messages, residual codes and sums; flags left at zero;
    the call counted; a poisoned call (a NaN vote) sends what the general CUDA encode
    sends for a NaN shard and keeps the residual."""
    flags = torch.zeros(2, dtype=torch.int32)
    for rank in range(world):
        grad, codes = case(world, blocks, block, dtype, rfmt, seed=world + 7 * rank)
        s = grad.numel() // world
        buf = torch.zeros(world, _tagc.quant_bytes(s, fmt, block), dtype=torch.uint8)
        want_codes = codes.clone()
        want_reset = _tagc.quant_unit_encode(buf, want_codes, grad, world, rank, fmt, rfmt,
                                             block, factor)
        for ok in (1, 0):
            ebuf = torch.zeros_like(buf)
            got = codes.clone()
            counts = torch.tensor([5, 6, 7, 8, 9])
            emu.quant_unit_encode(ebuf, got, grad, world, rank, fmt, rfmt, block, factor,
                                  counts=counts, flags=flags,
                                  vote=torch.tensor([0.0 if ok else float("nan")]))
            assert flags.tolist() == [0, 0]
            assert counts.tolist() == [5 + ok, 6 + 1 - ok, 7 + want_reset, 8 + ok * s,
                                       9 + ok * s]
            others = [r for r in range(world) if r != rank]
            if ok:
                assert torch.equal(ebuf[others], buf[others]) and torch.equal(got, want_codes)
                continue
            assert torch.equal(got, codes)
            for r in others:
                if s == 0:
                    continue
                x = grad[r * s:(r + 1) * s].float().clone()
                x[0] = float("nan")
                poisoned = torch.zeros_like(buf[r])
                emu.quant_encode(poisoned, torch.zeros(s), x, fmt, block)
                assert torch.equal(ebuf[r], poisoned)
        own = grad[rank * s:(rank + 1) * s]
        for out_dtype in (torch.float32, torch.bfloat16):
            want = torch.empty(s, dtype=out_dtype)
            _tagc.quant_unit_decode(want, buf, own, world, rank, fmt, block, 3.0)
            out = torch.empty(s, dtype=out_dtype)
            emu.quant_unit_decode(out, buf, own, world, rank, fmt, block, 3.0)
            assert same(out, want)


@pytest.mark.slow
def test_cuda_twin_resets_as_the_c_op(emu) -> None:
    grad, codes = case(2, 2, 64, torch.float32, "int4", seed=4)
    codes[36 * 3:36 * 3 + 4] = torch.tensor([0, 0, 0x80, 0x7F], dtype=torch.uint8)  # +Inf
    want = codes.clone()
    buf = torch.zeros(2, _tagc.quant_bytes(128, "int4", 64), dtype=torch.uint8)
    assert _tagc.quant_unit_encode(buf, want, grad, 2, 1, "int4", "int4", 64, 0.5) == 1
    ebuf, flags = torch.zeros_like(buf), torch.zeros(2, dtype=torch.int32)
    counts = torch.zeros(5, dtype=torch.int64)
    emu.quant_unit_encode(ebuf, codes, grad, 2, 1, "int4", "int4", 64, 0.5, counts=counts,
                          flags=flags)
    assert counts.tolist() == [1, 0, 1, 128, 128] and flags.tolist() == [0, 0]
    assert torch.equal(ebuf[0], buf[0]) and torch.equal(codes, want)


# ------------------------------------------------------------------------- the reducer
def run_reducer(preset: str, unit_path: bool, steps: int, out_dtype: torch.dtype,
                grad_dtype: torch.dtype, nan_step: Optional[int] = None,
                cuda_ops: Any = None
                ) -> Tuple[List[torch.Tensor], torch.Tensor, dict, List[bool]]:
    """Rank 0 of 2 on the loopback stand-in for a second rank: every output, the final
    residual codes, the counters, and which calls took the unit path; with ``cuda_ops``
    (an emulated ``_tagc``) on the reducer's CUDA branch."""
    from tagc_bench import cuda_emu
    from tagc_bench.cuda_hook import loopback

    cfg = tagc.TAGCConfig.preset(preset)
    n = 2 * 64 * 40
    u = UnitReducer(cfg, UnitSpec("unit", 0, n, n, n, torch.device("cpu")), None, 0, 2,
                    1.0, 2.0, CodecStreams())
    u.UNIT_PATH = unit_path
    g = torch.Generator().manual_seed(11)
    outs, paths = [], []
    branch = contextlib.nullcontext() if cuda_ops is None else cuda_emu.emulated_cuda(cuda_ops)
    with loopback(), branch:
        for step in range(steps):
            x = (torch.randn(n, generator=g) * (1 + step)).to(grad_dtype)
            if step == nan_step:
                x[7] = float("nan")
            out = torch.empty(n // 2, dtype=out_dtype)
            u.reduce(x, out)
            outs.append(out)
            paths.append(u.unit_call)
    return outs, u.residual, u.stats_dict(), paths


@pytest.mark.parametrize("preset", ["balanced", "full"])
@pytest.mark.parametrize("out_dtype,grad_dtype", [(torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_reducer_unit_path_equals_the_general_path(preset: str, out_dtype: torch.dtype,
                                                   grad_dtype: torch.dtype) -> None:
    """Outputs, the residual's codes and the counters, bit for bit, over steps with a
    non-finite gradient among them (the plain path, codes kept)."""
    a = run_reducer(preset, True, 6, out_dtype, grad_dtype, nan_step=3)
    b = run_reducer(preset, False, 6, out_dtype, grad_dtype, nan_step=3)
    assert a[3] == [True] * 6 and b[3] == [False] * 6
    for x, y in zip(a[0], b[0]):
        assert same(x, y) or (torch.isnan(x).any() and torch.isnan(y).any()
                              and torch.equal(torch.isnan(x), torch.isnan(y)))
    assert torch.equal(a[1], b[1])
    assert a[2] == b[2]


@pytest.mark.parametrize("unit_path", [False, True])
def test_cuda_branch_counts_no_sizes_of_a_poisoned_call(emu, unit_path: bool) -> None:
    """The CUDA branch (kernels emulated) over steps with a non-finite gradient: its
    counters are the CPU's, where that call took the plain path (a poisoned call's sizes
    count nowhere: the general path's host numbers join the device counter where the call
    was finite, the unit path's come from its encode kernel)."""
    cpu = run_reducer("balanced", unit_path, 4, torch.float32, torch.float32, nan_step=2)
    dev = run_reducer("balanced", unit_path, 4, torch.float32, torch.float32, nan_step=2,
                      cuda_ops=emu)
    assert cpu[3] == dev[3] == [unit_path] * 4
    cpu, dev = cpu[2], dev[2]
    assert dev["shard_slots"] == cpu["shard_slots"] == 3 * 64 * 40, (dev, cpu)
    for k in ("calls", "compressed_calls", "nonfinite_fallbacks", "union_size"):
        assert dev[k] == cpu[k], (k, dev[k], cpu[k])


def test_unit_path_not_taken_where_it_does_not_apply() -> None:
    """EF21, a residual kept as values, tls codes, shards that are not whole blocks."""
    for preset, fields in [("balanced", {"ef21": True, "residual_code": "none"}),
                           ("balanced", {"residual_code": "none"}),
                           ("lean", {}),
                           ("balanced", {"quant_block": 48})]:
        cfg = tagc.TAGCConfig.preset(preset, fields)
        n = 2 * 64 * 40
        u = UnitReducer(cfg, UnitSpec("unit", 0, n, n, n, torch.device("cpu")), None, 0, 2,
                        1.0, 2.0, CodecStreams())
        from tagc.device import Exec
        x = torch.zeros(n)
        assert not u._unit_eligible(Exec(x), x, torch.empty(n // 2)), (preset, fields)
