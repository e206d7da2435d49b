"""Ternary codes with two-level log scales (``_tagc.tls_*``), against a numpy reference
of csrc/tagc.h's contract: a block of 32's ternary scale as the nearest of its group's
scale times 2^(-b/3), a group of 512's as the nearest of the message's fp32 scale times
2^(-g/16), ternary codes five per byte across the message."""
from __future__ import annotations

import struct
from typing import Optional, Tuple

import numpy as np
import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

BLOCK, GROUP = 32, 16
FLT_MIN = np.float32(1.17549435e-38)
# the thresholds of the codes: geometric midpoints between neighbouring levels
MID16 = np.array([2.0 ** ((k + 0.5) / 16) for k in range(16)], dtype=np.float32)
MID3 = np.array([2.0 ** ((k + 0.5) / 3) for k in range(3)], dtype=np.float32)
LEV16 = np.array([2.0 ** (-k / 16) for k in range(16)], dtype=np.float32)
LEV3 = np.array([2.0 ** (-k / 3) for k in range(3)], dtype=np.float32)


# ----------------------------------------------------------------------------- reference
def size(n: int) -> int:
    """The contract's size: 4 + ceil(nb / 16) + ceil(nb / 2) + ceil(n / 5)."""
    if n == 0:
        return 0
    nb = -(-n // BLOCK)
    return 4 + -(-nb // GROUP) + (nb + 1) // 2 + -(-n // 5)


def log_code(x: np.ndarray, mids: np.ndarray, per: int, top: int) -> np.ndarray:
    """The level nearest in log2 to each ratio x > 0 (float32): -per log2 x rounded at
    the float32 midpoints, clamped to [0, top]; ratios below FLT_MIN give top."""
    x = x.astype(np.float32)
    m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1)
    y = (2 * m).astype(np.float32)
    c = (y[:, None] >= mids[None, :]).sum(axis=1)
    code = -per * (e.astype(np.int64) - 1) - c
    code = np.clip(code, 0, top)
    return np.where(x < FLT_MIN, top, code)


def shifted(f: np.ndarray, sh: np.ndarray) -> np.ndarray:
    """f 2^-sh in float32, 0 below FLT_MIN."""
    r = (f.astype(np.float32) * np.ldexp(np.float32(1), -sh).astype(np.float32)).astype(np.float32)
    return np.where(r < FLT_MIN, np.float32(0), r).astype(np.float32)


def raw_scales(v: np.ndarray) -> np.ndarray:
    """Per block of 32: min(2.5 mean|v|, max|v|), the sum in double by the 32-lane
    pairwise tree, 0 below FLT_MIN (the ternary format's scale)."""
    n = v.size
    nb = -(-n // BLOCK)
    a = np.zeros(nb * BLOCK, np.float32)
    a[:n] = np.abs(v)
    a = a.reshape(nb, BLOCK)
    lane = a.astype(np.float64)
    off = BLOCK // 2
    while off:
        lane[:, :off] = lane[:, :off] + lane[:, off:2 * off]
        off //= 2
    lens = np.full(nb, BLOCK, np.float64)
    lens[-1] = n - (nb - 1) * BLOCK
    s = np.minimum(2.5 * lane[:, 0] / lens, a.max(axis=1).astype(np.float64)).astype(np.float32)
    return np.where(s < FLT_MIN, np.float32(0), s)


def reference(grad: torch.Tensor, residual: Optional[torch.Tensor]) -> Tuple[bytes, np.ndarray,
                                                                              np.ndarray]:
    """(message, residual after, decoded values) of the contract."""
    v = grad.float().numpy().astype(np.float32)
    if residual is not None:
        v = (v + residual.float().numpy()).astype(np.float32)
    n = v.size
    if n == 0:
        return b"", v, v
    r = raw_scales(v)
    nb = r.size
    S = np.float32(r.max())
    ng = -(-nb // GROUP)
    gcodes = np.full(ng, 255, np.int64)
    bscale = np.zeros(nb, np.float32)
    bcodes = np.full(nb, 15, np.int64)
    for k in range(ng):
        blk = r[k * GROUP:(k + 1) * GROUP]
        R = blk.max()
        if R == 0:
            continue
        gc = int(log_code(np.array([np.float32(R) / S], np.float32), MID16, 16, 254)[0])
        M = shifted(np.array([S * LEV16[gc & 15]], np.float32), np.array([gc >> 4]))[0]
        if M == 0:
            continue
        gcodes[k] = gc
        live = blk > 0
        bc = np.full(blk.size, 15, np.int64)
        bc[live] = log_code((blk[live] / M).astype(np.float32), MID3, 3, 14)
        s = np.where(bc < 15, shifted((M * LEV3[bc % 3]).astype(np.float32), bc // 3), 0)
        bcodes[k * GROUP:(k + 1) * GROUP] = bc
        bscale[k * GROUP:(k + 1) * GROUP] = s
    s = np.repeat(bscale, BLOCK)[:n]
    inv = np.where(s > 0, (np.float32(1) / np.where(s > 0, s, 1)).astype(np.float32), 0)
    q = np.clip(np.rint(np.clip((v * inv).astype(np.float32), -2, 2)), -1, 1)
    dec = (q * s).astype(np.float32)
    after = (v - dec).astype(np.float32)
    if residual is not None and residual.dtype == torch.bfloat16:
        after = torch.from_numpy(after).to(torch.bfloat16).float().numpy()
    nib = np.zeros(nb + (nb & 1), np.int64)
    nib[:nb] = bcodes
    nibbles = (nib[0::2] | nib[1::2] << 4).astype(np.uint8)
    d = np.ones(-(-n // 5) * 5, np.int64)
    d[:n] = q + 1
    trits = (d.reshape(-1, 5) * np.array([1, 3, 9, 27, 81])).sum(axis=1).astype(np.uint8)
    msg = struct.pack("<f", S) + gcodes.astype(np.uint8).tobytes() + nibbles.tobytes() \
        + trits.tobytes()
    return msg, after, dec


def encode(grad: torch.Tensor, residual: Optional[torch.Tensor]) -> bytes:
    buf = torch.empty(_tagc.tls_bytes(grad.numel()), dtype=torch.uint8)
    _tagc.tls_encode(buf, residual, grad)
    return buf.numpy().tobytes()


def spread(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gradient-like values whose rows of 32 differ by up to 11 orders of magnitude, with
    exact zeros: what a layer's neurons give."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    rows = torch.pow(10.0, torch.empty(-(-n // BLOCK)).uniform_(-8, 3, generator=g))
    x = x * rows.repeat_interleave(BLOCK)[:n]
    x[torch.rand(n, generator=g) < 0.05] = 0
    return x.to(dtype)


# ----------------------------------------------------------------------------- tests
SIZES = (0, 1, 5, 31, 32, 33, 160, 511, 512, 513, 1000, 4099, 40961)


@pytest.mark.parametrize("n", (0, 1, 2, 31, 32, 33, 511, 512, 513, 8192, 1 << 24, _tagc.MAX_N))
def test_bytes_is_the_layout(n: int) -> None:
    assert _tagc.tls_bytes(n) == size(n)


def test_bytes_bits_per_value() -> None:
    assert 8 * _tagc.tls_bytes(1 << 20) / (1 << 20) == pytest.approx(1.6 + 4 / 32 + 8 / 512,
                                                                      abs=1e-3)


@pytest.mark.parametrize("bad", (-1, _tagc.MAX_N + 1, 1.0, True, "3"))
def test_bytes_refuses_bad_n(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        _tagc.tls_bytes(bad)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gd", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rd", (None, torch.float32, torch.bfloat16))
def test_encode_decode_match_the_reference(n: int, gd: torch.dtype,
                                           rd: Optional[torch.dtype]) -> None:
    grad = spread(n, n + 7, gd)
    res = None if rd is None else (spread(n, n + 8) * 0.3).to(rd)
    msg, after, dec = reference(grad, res)
    got = encode(grad, res)
    assert got == msg
    if res is not None:
        assert torch.equal(res.float(), torch.from_numpy(after))
    base = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = base.clone()
    _tagc.tls_decode_add(out, torch.frombuffer(bytearray(got), dtype=torch.uint8)
                         if n else torch.empty(0, dtype=torch.uint8))
    assert torch.equal(out, base + torch.from_numpy(dec))


def test_two_to_the_24() -> None:
    n = 1 << 24
    grad = spread(n, 24)
    msg, _, dec = reference(grad, None)
    buf = torch.empty(_tagc.tls_bytes(n), dtype=torch.uint8)
    _tagc.tls_encode(buf, None, grad)
    assert buf.numpy().tobytes() == msg
    out = torch.zeros(n)
    _tagc.tls_decode_add(out, buf)
    assert torch.equal(out, torch.from_numpy(dec))


def test_sent_plus_residual_is_the_input() -> None:
    grad, res = spread(5000, 1), spread(5000, 2) * 0.1
    v = grad + res
    buf = torch.empty(_tagc.tls_bytes(5000), dtype=torch.uint8)
    _tagc.tls_encode(buf, res, grad)
    out = torch.zeros(5000)
    _tagc.tls_decode_add(out, buf)
    assert torch.allclose(out + res, v, rtol=1e-6, atol=0)


def test_zeros_send_zero_scales_and_zero_codes() -> None:
    n = 1000
    buf = torch.empty(_tagc.tls_bytes(n), dtype=torch.uint8)
    _tagc.tls_encode(buf, None, torch.zeros(n))
    b = buf.numpy().tobytes()
    nb, ng = -(-n // 32), -(-n // 512)
    assert struct.unpack("<f", b[:4])[0] == 0.0
    assert set(b[4:4 + ng]) == {255}
    assert set(b[4 + ng:4 + ng + nb // 2]) == {0xFF}
    assert set(b[4 + ng + (nb + 1) // 2:]) == {121}  # five digits 1: code 0


def test_finer_scales_keep_small_rows() -> None:
    """The point of the code: a row of 32 a few times below its neighbours still gets
    through, where one ternary scale per 256 values sends it mostly as zeros."""
    n = 1 << 16
    g = torch.Generator().manual_seed(3)
    rows = torch.pow(10.0, torch.empty(n // BLOCK).uniform_(-1.3, 0, generator=g))
    x = torch.randn(n, generator=g) * rows.repeat_interleave(BLOCK)
    buf = torch.empty(_tagc.tls_bytes(n), dtype=torch.uint8)
    _tagc.tls_encode(buf, None, x)
    tls = torch.zeros_like(x)
    _tagc.tls_decode_add(tls, buf)
    q = torch.empty(_tagc.quant_bytes(n, "ternary", 256), dtype=torch.uint8)
    _tagc.quant_encode(q, None, x, "ternary", 256)
    ter = torch.zeros_like(x)
    _tagc.quant_decode_add(ter, q, "ternary", 256)
    top = x.view(-1, BLOCK).abs().amax(dim=1)
    small = top < top.view(-1, 8).amax(dim=1).repeat_interleave(8) / 5

    def err(c: torch.Tensor) -> float:
        d = (c - x).view(-1, BLOCK)[small]
        return float((d * d).sum() / (x.view(-1, BLOCK)[small] ** 2).sum())

    assert small.sum() > 100
    assert err(tls) < 0.5 and err(ter) > 0.85
    assert buf.numel() <= q.numel()


@pytest.mark.parametrize("bad", (float("nan"), float("inf"), -float("inf")))
@pytest.mark.parametrize("where", ("grad", "residual"))
@pytest.mark.parametrize("at", (333, 650))
def test_nonfinite_raises_and_leaves_the_residual(bad: float, where: str, at: int) -> None:
    """At 333 the AVX2 encoder meets it eight blocks a step, at 650 in the tail's blocks."""
    grad, res = spread(700, 4), spread(700, 5)
    (grad if where == "grad" else res)[at] = bad
    keep = res.clone()
    buf = torch.empty(_tagc.tls_bytes(700), dtype=torch.uint8)
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.tls_encode(buf, res, grad)
    assert torch.equal(res, keep) if where == "grad" else torch.equal(res.nan_to_num(),
                                                                       keep.nan_to_num())


def coded(n: int) -> torch.Tensor:
    buf = torch.empty(_tagc.tls_bytes(n), dtype=torch.uint8)
    _tagc.tls_encode(buf, None, spread(n, 6))
    return buf


@pytest.mark.parametrize("header", (-1.0, -0.0, float("inf"), -float("inf")))
def test_decode_refuses_a_bad_message_scale(header: float) -> None:
    buf = coded(600)
    buf[:4] = torch.frombuffer(bytearray(struct.pack("<f", header)), dtype=torch.uint8)
    out = torch.ones(600)
    with pytest.raises(ValueError, match="out untouched"):
        _tagc.tls_decode_add(out, buf)
    assert torch.equal(out, torch.ones(600))


@pytest.mark.parametrize("byte", (243, 255))
def test_decode_refuses_a_code_outside_the_format(byte: int) -> None:
    buf = coded(600)
    buf[-1] = byte
    out = torch.ones(600)
    with pytest.raises(ValueError, match="out untouched"):
        _tagc.tls_decode_add(out, buf)
    assert torch.equal(out, torch.ones(600))


def test_a_nan_message_scale_is_data() -> None:
    buf = coded(100)
    buf[:4] = torch.frombuffer(bytearray(struct.pack("<f", float("nan"))), dtype=torch.uint8)
    out = torch.zeros(100)
    _tagc.tls_decode_add(out, buf)
    assert torch.isnan(out).all()


def test_bad_arguments_raise() -> None:
    g = torch.randn(100)
    buf = torch.empty(_tagc.tls_bytes(100), dtype=torch.uint8)
    with pytest.raises(TypeError):
        _tagc.tls_encode(buf, None, g.to(torch.float64))
    with pytest.raises(TypeError):
        _tagc.tls_encode(buf.to(torch.int8), None, g)
    with pytest.raises(ValueError, match="tls_bytes"):
        _tagc.tls_encode(buf[:-1], None, g)
    with pytest.raises(ValueError):
        _tagc.tls_encode(buf, torch.zeros(99), g)
    with pytest.raises(TypeError, match="contiguous"):
        _tagc.tls_encode(buf, None, g.view(10, 10).t())
    with pytest.raises(ValueError):
        _tagc.tls_encode(buf, g, g)  # the residual is the input: refused, never aliased
    _tagc.tls_encode(buf, None, g)
    with pytest.raises(TypeError):
        _tagc.tls_decode_add(torch.zeros(100, dtype=torch.bfloat16), buf)
    with pytest.raises(ValueError, match="tls_bytes"):
        _tagc.tls_decode_add(torch.zeros(101), buf)
    with pytest.raises(TypeError):
        _tagc.tls_decode_add(torch.zeros(100), buf, block=32)
