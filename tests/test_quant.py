"""The block quantizer of `_tagc` (quant_bytes/quant_encode/quant_decode_add)
against an independent numpy reference of csrc/tagc.h's wire format.

The reference re-derives every byte: block statistics (the sum of |v| in 32
strided float64 partial sums then a pairwise tree, or max |v|), the scale
rule per format, round-half-even codes, digit packing (sign bits, base-3
ternary, int4 nibbles, int8), and the residual v - q*s.  Nothing here calls
`_tagc` to compute an expected value.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

FORMATS = ("sign", "ternary", "int4", "int8")
PER_BYTE = {"sign": 8, "ternary": 5, "int4": 2, "int8": 1}
QMAX = {"sign": 1, "ternary": 1, "int4": 7, "int8": 127}
TERNARY_LEVEL = 2.5  # tagc_portable.h TAGC_TERNARY_LEVEL
FLT_MAX = float(np.finfo(np.float32).max)


def bytes_ref(n: int, fmt: str, block: int) -> int:
    """Wire size: per block 4 scale bytes + ceil(len / codes per byte)."""
    per = PER_BYTE[fmt]
    full, tail = divmod(n, block)
    return full * (4 + -(-block // per)) + (4 + -(-tail // per) if tail else 0)


def block_sum_abs(x: np.ndarray) -> float:
    """Sum of |x| in the codec's fixed order: 32 strided float64 partial sums
    (each sequential), then lane j += lane j + off for off = 16, 8, 4, 2, 1."""
    a = np.abs(x.astype(np.float32)).astype(np.float64)
    lanes = np.zeros(32)
    for j in range(32):
        col = a[j::32]
        if col.size:
            lanes[j] = np.cumsum(col)[-1]  # cumsum is strictly sequential
    off = 16
    while off:
        lanes[:off] = lanes[:off] + lanes[off:2 * off]
        off //= 2
    return float(lanes[0])


FLT_MIN = float(np.finfo(np.float32).tiny)


def scale_ref(x: np.ndarray, fmt: str) -> np.float32:
    """The block's scale: rounded to float32 once, clamped to FLT_MAX, nudged
    down when max code * scale would overflow, and 0 below FLT_MIN."""
    if fmt == "sign":
        s = block_sum_abs(x) / x.size
    elif fmt == "ternary":  # capped at max |x|: the largest value always goes out
        s = min(TERNARY_LEVEL * block_sum_abs(x) / x.size, float(np.abs(x).max()))
    else:
        s = float(np.abs(x).max()) / QMAX[fmt]
    f = np.float32(min(s, FLT_MAX))
    if float(f) * QMAX[fmt] > FLT_MAX:
        f = np.nextafter(f, np.float32(0))
    return np.float32(0) if f < FLT_MIN else f


def codes_ref(x: np.ndarray, s: np.float32, fmt: str) -> np.ndarray:
    """Integer codes of one block: x times the float32 reciprocal of s, rounded
    half to even, clamped (0 where s == 0)."""
    if fmt == "sign":
        return np.where(x >= 0, 1, -1).astype(np.int64)
    inv = np.float32(1) / s if s > 0 else np.float32(0)
    y = np.rint((x * inv).astype(np.float32))
    return np.clip(y, -QMAX[fmt], QMAX[fmt]).astype(np.int64)


def pack_ref(q: np.ndarray, fmt: str) -> bytes:
    """Packed code bytes of one block, unused positions holding the code of 0."""
    per = PER_BYTE[fmt]
    digit = {"sign": (q > 0).astype(np.int64), "ternary": q + 1, "int4": q + 7,
             "int8": q & 0xFF}[fmt]
    pad = {"sign": 0, "ternary": 1, "int4": 7, "int8": 0}[fmt]
    nb = -(-q.size // per)
    d = np.full(nb * per, pad, dtype=np.int64)
    d[:q.size] = digit
    base = {"sign": 2, "ternary": 3, "int4": 16, "int8": 256}[fmt]
    weights = base ** np.arange(per, dtype=np.int64)
    return bytes((d.reshape(nb, per) * weights).sum(axis=1).astype(np.uint8))


def encode_ref(v: np.ndarray, fmt: str, block: int) -> Tuple[bytes, np.ndarray]:
    """(wire bytes, dequantized values q*s in float32) of float32 values v."""
    out, deq = bytearray(), np.zeros(v.size, dtype=np.float32)
    for o in range(0, v.size, block):
        x = v[o:o + block]
        s = scale_ref(x, fmt)
        q = codes_ref(x, s, fmt)
        out += np.array([s], dtype="<f4").tobytes() + pack_ref(q, fmt)
        deq[o:o + x.size] = (q.astype(np.float32) * s).astype(np.float32)
    return bytes(out), deq


def owner_format_ref(quant_format: str, hsdp_out_format: str) -> str:
    """The code two-phase HSDP's owners use for their sums, restated for the
    references (``TAGCConfig.out_format``): ``auto`` is int4 after ternary/sign."""
    if hsdp_out_format != "auto":
        return hsdp_out_format
    return "int4" if quant_format in ("ternary", "sign") else quant_format


def gradient(n: int, seed: int, kind: str = "randn") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(n, generator=g)
    if kind == "heavy":  # a few entries 100x the rest, as in real gradients
        x = torch.randn(n, generator=g)
        x[torch.rand(n, generator=g) < 0.01] *= 100
        return x
    if kind == "ties":  # exact .5 multiples of the scale hit round-half-even
        return torch.randint(-8, 9, (n,), generator=g).float() / 2
    raise ValueError(kind)


def encode(grad: torch.Tensor, residual: Optional[torch.Tensor], fmt: str,
           block: int) -> torch.Tensor:
    buf = torch.full((_tagc.quant_bytes(grad.numel(), fmt, block),), 0xAB, dtype=torch.uint8)
    _tagc.quant_encode(buf, residual, grad, fmt, block)
    return buf


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 257, 1001, 65537])
@pytest.mark.parametrize("block", [1, 5, 256, 1000])
def test_quant_bytes_formula(fmt: str, n: int, block: int) -> None:
    assert _tagc.quant_bytes(n, fmt, block) == bytes_ref(n, fmt, block)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,block", [(1, 256), (7, 256), (256, 256), (257, 256), (1001, 64),
                                     (3000, 1000), (40, 1), (13, 5)])
@pytest.mark.parametrize("kind", ["randn", "heavy", "ties"])
def test_encode_matches_reference(fmt: str, n: int, block: int, kind: str) -> None:
    grad = gradient(n, seed=n + block, kind=kind)
    res = gradient(n, seed=n + block + 1) * 0.1
    v = (grad + res).numpy()  # fp32 sum, as the codec forms it
    want, deq = encode_ref(v, fmt, block)
    buf = encode(grad, res, fmt, block)
    assert bytes(buf.numpy()) == want
    # error feedback: the residual is exactly what the owner will not get
    assert torch.equal(res, torch.from_numpy(v - deq))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [None, torch.float32, torch.bfloat16])
def test_encode_dtypes(fmt: str, gd: torch.dtype, rd: Optional[torch.dtype]) -> None:
    grad = gradient(777, seed=3, kind="heavy").to(gd)
    res = None if rd is None else (gradient(777, seed=4) * 0.3).to(rd)
    v = grad.float() + (0 if res is None else res.float())
    want, deq = encode_ref(v.numpy(), fmt, 128)
    buf = encode(grad, res, fmt, 128)
    assert bytes(buf.numpy()) == want
    if res is not None:
        assert torch.equal(res, (v - torch.from_numpy(deq)).to(rd))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 255, 1001, 100_003])
def test_decode_adds_what_was_encoded(fmt: str, n: int) -> None:
    grad = gradient(n, seed=n)
    res = torch.zeros(n)
    buf = encode(grad, res, fmt, 256)
    base = gradient(n, seed=n + 9)
    out = base.clone()
    _tagc.quant_decode_add(out, buf, fmt, 256)
    _, deq = encode_ref(grad.numpy(), fmt, 256)
    assert torch.equal(out, base + torch.from_numpy(deq))
    # nothing lost: what the owner got plus what stayed behind is v
    decoded = torch.zeros(n)
    _tagc.quant_decode_add(decoded, buf, fmt, 256)
    torch.testing.assert_close(decoded + res, grad, rtol=0, atol=2e-6 * float(grad.abs().max()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_delivers_everything_over_steps(fmt: str) -> None:
    """The same heavy-tailed gradient every step: sent + residual is exactly
    everything so far, the residual stays bounded, so the mean of what is sent
    converges to the gradient like 1/steps (error feedback), coarse formats
    included."""
    n = 3000
    grad = gradient(n, seed=11, kind="heavy")
    res = torch.zeros(n)
    total = torch.zeros(n)
    norms, errs = {}, {}
    for step in range(1, 1601):
        buf = encode(grad, res, fmt, 256)
        _tagc.quant_decode_add(total, buf, fmt, 256)
        if step in (800, 1600):
            torch.testing.assert_close(total + res, step * grad, rtol=1e-4,
                                       atol=1e-5 * step * float(grad.abs().max()))
            norms[step] = float(res.norm())
            errs[step] = float((total / step - grad).norm() / grad.norm())
    # a 100x outlier needs ~100 steps of accumulation before a coarse code
    # sends it, so the residual settles late (sign: ~800 steps), then stays
    assert norms[1600] < 1.2 * norms[800]
    assert errs[1600] < 0.1
    assert errs[1600] < 0.6 * errs[800] or errs[1600] < 1e-4  # int8: at fp32 rounding


def test_huge_shard_int4() -> None:
    """2^24 + 3 values (a 64 MB shard): bytes and residual as the reference."""
    n = (1 << 24) + 3
    grad = gradient(n, seed=5)
    res = torch.zeros(n)
    buf = encode(grad, res, "int4", 256)
    g = grad.numpy()
    nb = -(-n // 256)
    pad = np.zeros(nb * 256, dtype=np.float32)
    pad[:n] = g
    blocks = pad.reshape(nb, 256)
    s = (np.abs(blocks).max(axis=1).astype(np.float64) / 7).astype(np.float32)
    inv = (np.float32(1) / s).astype(np.float32)
    q = np.clip(np.rint((blocks * inv[:, None]).astype(np.float32)), -7, 7)
    deq = (q.astype(np.float32) * s[:, None]).reshape(-1)[:n]
    assert torch.equal(res, torch.from_numpy(g - deq))
    scales = np.frombuffer(bytes(buf[:(nb - 1) * 132].numpy()), dtype=np.uint8)
    scales = scales.reshape(nb - 1, 132)[:, :4].copy().view("<f4").reshape(-1)
    assert np.array_equal(scales, s[:-1])


def test_zero_and_tiny_blocks() -> None:
    """All-zero blocks decode to zeros in every format; values whose squares
    would underflow still get a finite, non-zero scale."""
    for fmt in FORMATS:
        grad = torch.zeros(300)
        res = torch.zeros(300)
        out = torch.zeros(300)
        _tagc.quant_decode_add(out, encode(grad, res, fmt, 256), fmt, 256)
        assert torch.equal(out, torch.zeros(300)) and torch.equal(res, torch.zeros(300))
        tiny = torch.full((64,), 1e-30)
        r = torch.zeros(64)
        out = torch.zeros(64)
        _tagc.quant_decode_add(out, encode(tiny, r, fmt, 64), fmt, 64)
        torch.testing.assert_close(out + r, tiny, rtol=1e-6, atol=0)
        assert out.abs().sum() > 0


def test_huge_values_keep_a_finite_scale() -> None:
    """Values near FLT_MAX: the scale is clamped, never inf, so nothing decodes to NaN."""
    x = torch.tensor([3e38, -3e38, 1.0, 2e38] * 8)
    for fmt in FORMATS:
        r = torch.zeros_like(x)
        out = torch.zeros_like(x)
        _tagc.quant_decode_add(out, encode(x, r, fmt, 32), fmt, 32)
        assert torch.isfinite(out).all() and torch.isfinite(r).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_leaves_residual_untouched(fmt: str, bad: float) -> None:
    grad = gradient(600, seed=1)
    grad[450] = bad
    res = gradient(600, seed=2)
    r0 = res.clone()
    buf = torch.empty(_tagc.quant_bytes(600, fmt, 256), dtype=torch.uint8)
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.quant_encode(buf, res, grad, fmt, 256)
    assert torch.equal(res, r0)


INVALID = {"ternary": (243, 255), "int4": (0x0F, 0xF0), "int8": (0x80,)}


@pytest.mark.parametrize("fmt", ["ternary", "int4", "int8"])
def test_decode_rejects_invalid_codes_untouched(fmt: str) -> None:
    grad = gradient(500, seed=8)
    buf = encode(grad, None, fmt, 256)
    for byte in INVALID[fmt]:
        bad = buf.clone()
        bad[4 + 3] = byte  # a code byte of the first record
        out = torch.ones(500)
        with pytest.raises(ValueError, match="code outside the format"):
            _tagc.quant_decode_add(out, bad, fmt, 256)
        assert torch.equal(out, torch.ones(500))


def test_decode_ignores_padding_and_accepts_nonfinite_scales() -> None:
    """Codes past a block's end are not data; a NaN scale is data (it carries
    a non-finite gradient to the owner) and reaches out."""
    buf = encode(gradient(7, seed=1), None, "int4", 256)  # 4 code bytes, 1 pad nibble
    buf[-1] |= 0xF0
    out = torch.zeros(7)
    _tagc.quant_decode_add(out, buf, "int4", 256)
    buf[:4] = torch.tensor(bytearray(np.array([np.nan], dtype="<f4").tobytes()),
                           dtype=torch.uint8)
    out = torch.zeros(7)
    _tagc.quant_decode_add(out, buf, "int4", 256)
    assert torch.isnan(out).all()


def test_unaligned_buffers() -> None:
    grad = gradient(1001, seed=4)
    n = _tagc.quant_bytes(1001, "int8", 100)
    big = torch.zeros(n + 3, dtype=torch.uint8)
    _tagc.quant_encode(big[3:], None, grad, "int8", 100)
    want, deq = encode_ref(grad.numpy(), "int8", 100)
    assert bytes(big[3:].numpy()) == want
    out = torch.zeros(1001)
    _tagc.quant_decode_add(out, big[3:], "int8", 100)
    assert torch.equal(out, torch.from_numpy(deq))


def _f(n: int) -> torch.Tensor:
    return torch.zeros(n)


def _u8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


BAD = [
    (lambda: _tagc.quant_bytes(10, "int3", 256), ValueError, "'format'"),
    (lambda: _tagc.quant_bytes(10, 4, 256), ValueError, "'format'"),
    (lambda: _tagc.quant_bytes(-1, "int4", 256), ValueError, "'n'"),
    (lambda: _tagc.quant_bytes(10, "int4", 0), ValueError, "'block'"),
    (lambda: _tagc.quant_bytes(10, "int4", 65537), ValueError, "'block'"),
    (lambda: _tagc.quant_bytes(10, "int4", 2.0), TypeError, "'block'"),
    (lambda: _tagc.quant_encode(_u8(8), None, _f(10), "int4", 256), ValueError, "'buf'"),
    (lambda: _tagc.quant_encode(_u8(9), _f(9), _f(10), "int4", 256), ValueError, "'residual'"),
    (lambda: _tagc.quant_encode(_u8(9), None, torch.zeros(10, dtype=torch.float16), "int4", 256),
     TypeError, "'grad'"),
    (lambda: _tagc.quant_encode(_f(9), None, _f(10), "int4", 256), TypeError, "'buf'"),
    (lambda: _tagc.quant_encode(_u8(9), None, _f(10), "nope", 256), ValueError, "'format'"),
    (lambda: _tagc.quant_encode(_u8(9), None, _f(10).requires_grad_(), "int4", 256),
     TypeError, "grad"),
    (lambda: _tagc.quant_decode_add(_f(10), _u8(10), "int4", 256), ValueError, "'buf'"),
    (lambda: _tagc.quant_decode_add(_f(10), _u8(8), "int4", 256), ValueError, "'buf'"),
    (lambda: _tagc.quant_decode_add(torch.zeros(10, dtype=torch.bfloat16), _u8(9), "int4", 256),
     TypeError, "'out'"),
    (lambda: _tagc.quant_decode_add(_f(10), _u8(9), "int4", 256, status_out=_f(1)),
     TypeError, "'status_out'"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_raise(case: int) -> None:
    fn, exc, text = BAD[case]
    with pytest.raises(exc, match=text):
        fn()


def test_overlapping_arguments_raise() -> None:
    g = torch.zeros(64)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.quant_encode(g.view(torch.uint8)[40:60], None, g[8:24], "int8", 16)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.quant_encode(_u8(_tagc.quant_bytes(16, "int8", 16)), g[:16], g[8:24], "int8", 16)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.quant_decode_add(g[:16], g.view(torch.uint8)[60:60 + 20], "int8", 16)
