"""The quantized weight gather of `_tagc` (wq_bytes / wq_encode / wq_decode)
against an independent pure-torch reference of csrc/tagc.h's wq layout.

The reference quantizes each segment on its own (blocks never cross a
segment): rows of `block` values (the segment zero-padded to whole rows),
the row max |v| divided by qmax in float64 and rounded once to float32, the
float32 reciprocal, torch.round (half to even) and a clamp for the codes,
then its own packing (int8 two's complement bytes; int4 nibbles q + 7, value
2j in the low nibble, a pad nibble 7).  Nothing here calls `_tagc` to
compute an expected value.
"""
from __future__ import annotations

import inspect
import struct
from typing import List, Sequence, Tuple

import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

FORMATS = ("int8", "int4")
QMAX = {"int8": 127, "int4": 7}
PER_BYTE = {"int8": 1, "int4": 2}
SENTINEL = 0x7FC0FFEE  # tagc.h TAGC_WQ_NONFINITE
FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny
DTYPES = (torch.float32, torch.bfloat16)


def record_bytes(length: int, fmt: str) -> int:
    return 4 + -(-length // PER_BYTE[fmt])


def bytes_ref(segs: Sequence[int], fmt: str, block: int) -> int:
    total = 0
    for length in segs:
        full, tail = divmod(length, block)
        total += full * record_bytes(block, fmt) + (record_bytes(tail, fmt) if tail else 0)
    return total


def quantize_rows(rows: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale bits int64 [nb], codes int64 [nb, block], dequantized float32
    [nb, block]) of float32 rows; a row with NaN/Inf gets the sentinel, codes
    0 and NaN values (never compared: decode refuses such a message)."""
    qmax = QMAX[fmt]
    finite = torch.isfinite(rows).all(dim=1)
    clean = torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows))
    s = (clean.abs().amax(dim=1).double() / qmax).float()
    over = s.double() * qmax > FLT_MAX
    s[over] = torch.nextafter(s[over], torch.zeros_like(s[over]))
    s[s < FLT_MIN] = 0.0
    inv = torch.where(s > 0, torch.ones_like(s) / torch.where(s > 0, s, torch.ones_like(s)),
                      torch.zeros_like(s))
    q = torch.round(clean * inv[:, None]).clamp(-qmax, qmax).to(torch.int64)
    q[~finite] = 0
    bits = s.view(torch.int32).to(torch.int64)
    bits[~finite] = SENTINEL
    deq = q.to(torch.float32) * s[:, None]
    deq[~finite] = float("nan")
    return bits, q, deq


def pack_codes(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 [nb, bytes per row] of codes [nb, block] (block even for int4)."""
    if fmt == "int8":
        return (q & 0xFF).to(torch.uint8)
    d = q + 7
    return (d[:, 0::2] | (d[:, 1::2] << 4)).to(torch.uint8)


def encode_ref(x: torch.Tensor, segs: Sequence[int], fmt: str,
               block: int) -> Tuple[bytes, torch.Tensor]:
    """(message bytes, dequantized float32 values) of x (any float dtype)."""
    v = x.float()
    out, deq, o = bytearray(), torch.empty(v.numel()), 0
    for length in segs:
        if length == 0:
            continue
        nb = -(-length // block)
        width = block + (block % PER_BYTE[fmt])  # int4, odd block: a pad code per row
        rows = torch.zeros(nb, width)
        padded = torch.zeros(nb * block)
        padded[:length] = v[o:o + length]
        rows[:, :block] = padded.view(nb, block)
        bits, q, dq = quantize_rows(rows, fmt)
        q[:, block:] = 0  # the pad code of an odd block
        codes = pack_codes(q, fmt)
        for r in range(nb):
            n_r = min(block, length - r * block)
            out += struct.pack("<I", int(bits[r]) & 0xFFFFFFFF)
            out += bytes(codes[r, :-(-n_r // PER_BYTE[fmt])].numpy())
        deq[o:o + length] = dq[:, :block].reshape(-1)[:length]
        o += length
    return bytes(out), deq


def weights(n: int, seed: int, dtype: torch.dtype = torch.float32,
            kind: str = "randn") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(n, generator=g)
    elif kind == "ties":  # multiples of half a step: round-half-even decides
        x = torch.randint(-254, 255, (n,), generator=g).float() / 2
    elif kind == "spread":  # magnitudes over many binades, zeros and tiny blocks
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g)
                                                     .float())
        x[torch.rand(n, generator=g) < 0.1] = 0.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


def encode(x: torch.Tensor, segs, fmt: str, block: int) -> torch.Tensor:
    buf = torch.full((_tagc.wq_bytes(segs, fmt, block),), 0xAB, dtype=torch.uint8)
    _tagc.wq_encode(buf, x, segs, fmt, block)
    return buf


def decode(buf: torch.Tensor, segs, n: int, fmt: str, block: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.full((n,), 5.0, dtype=dtype)
    _tagc.wq_decode(out, buf, segs, fmt, block)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def many_segments(seed: int) -> List[int]:
    """60 segments, a third of them empty, the rest 1..700 values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 701, (60,), generator=g)
    lengths[torch.rand(60, generator=g) < 0.33] = 0
    return [int(v) for v in lengths]


SEGS = [[], [0], [0, 0], [1], [7], [256], [257], [3, 0, 5], [1000, 1, 999], [255, 0, 0, 513],
        many_segments(1), many_segments(2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [1, 2, 5, 64, 255, 256, 65536])
def test_bytes_formula(fmt: str, block: int) -> None:
    for segs in SEGS:
        want = bytes_ref(segs, fmt, block)
        assert _tagc.wq_bytes(segs, fmt, block) == want
        assert _tagc.wq_bytes(torch.tensor(segs, dtype=torch.int64), fmt, block) == want
        assert _tagc.wq_bytes(tuple(segs), format=fmt, block=block) == want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("si", range(len(SEGS)))
@pytest.mark.parametrize("block", [1, 5, 64, 256])
@pytest.mark.parametrize("sd", DTYPES)
def test_encode_decode_match_reference(fmt: str, si: int, block: int, sd: torch.dtype) -> None:
    segs = SEGS[si]
    n = sum(segs)
    x = weights(n, seed=si * 7 + block, dtype=sd, kind=("randn", "ties", "spread")[si % 3])
    want, deq = encode_ref(x, segs, fmt, block)
    buf = encode(x, segs, fmt, block)
    assert bytes(buf.numpy()) == want
    assert same_bits(decode(buf, segs, n, fmt, block), deq)
    assert same_bits(decode(buf, segs, n, fmt, block, torch.bfloat16), deq.to(torch.bfloat16))
    segs_t = torch.tensor(segs, dtype=torch.int64)  # the tensor form reads the same table
    again = torch.empty_like(buf)
    _tagc.wq_encode(again, x, segs_t, fmt, block)
    assert torch.equal(again, buf)
    assert same_bits(decode(buf, segs_t, n, fmt, block), deq)


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_never_cross_segments(fmt: str) -> None:
    """One huge value in a segment does not touch its neighbour's scale."""
    x = torch.cat([torch.full((10,), 1000.0), torch.full((10,), 0.001)])
    buf = encode(x, [10, 10], fmt, 64)
    scales = struct.unpack("<f", bytes(buf[:4].numpy()))[0], \
        struct.unpack("<f", bytes(buf[record_bytes(10, fmt):][:4].numpy()))[0]
    assert scales[0] == pytest.approx(1000.0 / QMAX[fmt])
    assert scales[1] == pytest.approx(0.001 / QMAX[fmt])
    torch.testing.assert_close(decode(buf, [10, 10], 20, fmt, 64), x, rtol=1e-6, atol=0)


def test_hand_checked_bytes() -> None:
    """Two tiny messages written out by hand."""
    # int8, one segment of 3, block 2: [127, -63.5] -> s = 1, q = (127, -64);
    # then [0.5] -> s = 0.5/127, q = 127
    buf = encode(torch.tensor([127.0, -63.5, 0.5]), [3], "int8", 2)
    s2 = struct.pack("<f", torch.tensor(0.5 / 127, dtype=torch.float32).item())
    assert bytes(buf.numpy()) == struct.pack("<f", 1.0) + bytes([127, 0xC0]) + s2 + bytes([127])
    # int4, segments (3, 1), block 4: [7, -3.5, 0] -> s = 1, q = (7, -4, 0);
    # [-1] -> s = 1/7, q = -7; nibbles q + 7, pad 7
    buf = encode(torch.tensor([7.0, -3.5, 0.0, -1.0]), [3, 1], "int4", 4)
    s2 = struct.pack("<f", torch.tensor(1 / 7, dtype=torch.float32).item())
    assert bytes(buf.numpy()) == (struct.pack("<f", 1.0) + bytes([0x3E, 0x77]) + s2
                                  + bytes([0x70]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sd", DTYPES)
@pytest.mark.parametrize("kind", ["randn", "ties", "spread"])
def test_reencoding_decoded_weights_is_a_fixed_point(fmt: str, sd: torch.dtype, kind: str) -> None:
    """decode -> encode gives the same bytes: the block max m decodes to
    RN(qmax * RN(m / qmax)) == m, the largest code is qmax again and every
    other q * s codes back to q.  Also with a bf16 out when the weights are
    bf16 (m is a bf16, and bf16 keeps q * s within qmax 2^-9 s of itself)."""
    segs = [300, 0, 1, 257, 1000]
    n = sum(segs)
    x = weights(n, seed=3, dtype=sd, kind=kind)
    buf = encode(x, segs, fmt, 128)
    for od in DTYPES if sd == torch.bfloat16 else (torch.float32,):
        y = decode(buf, segs, n, fmt, 128, od)
        assert torch.equal(encode(y, segs, fmt, 128), buf)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_out_of_fp32_weights_is_a_fixed_point_after_one_round(fmt: str) -> None:
    """Not at once: bf16 rounds the block max m of fp32 weights (8 significant
    bits), which moves the next scale (values stay within a step of the first
    decode).  From the second message on, the bytes are a fixed point: its
    block maxima are bf16 already."""
    segs = [4000, 0, 999]
    x = weights(4999, seed=9)
    buf = encode(x, segs, fmt, 256)
    y = decode(buf, segs, 4999, fmt, 256, torch.bfloat16)
    buf2 = encode(y, segs, fmt, 256)
    assert not torch.equal(buf2, buf)
    _, deq = encode_ref(y, segs, fmt, 256)
    torch.testing.assert_close(deq, decode(buf, segs, 4999, fmt, 256), rtol=0,
                               atol=float(x.abs().max()) / QMAX[fmt] * 1.01)
    y2 = decode(buf2, segs, 4999, fmt, 256, torch.bfloat16)
    assert torch.equal(encode(y2, segs, fmt, 256), buf2)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_shard(fmt: str) -> None:
    """2^24 + 3 values in a few segments (blocks not dividing them)."""
    segs = [(1 << 23) + 1, 0, 4095, (1 << 23) - 4093]
    n = sum(segs)
    assert n == (1 << 24) + 3
    x = weights(n, seed=11)
    want, deq = encode_ref(x, segs, fmt, 256)
    buf = encode(x, segs, fmt, 256)
    assert buf.numel() == len(want) and bytes(buf.numpy()) == want
    assert same_bits(decode(buf, segs, n, fmt, 256), deq)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("sd", DTYPES)
def test_nonfinite_block_is_flagged(fmt: str, bad: float, sd: torch.dtype) -> None:
    """The block holding NaN/Inf gets the sentinel scale and codes 0, every
    other record is as usual, and decode refuses with out untouched."""
    segs = [100, 77, 300]
    x = weights(477, seed=5, dtype=sd)
    x[100 + 70] = bad  # segment 1, block 1 (blocks of 64)
    buf = encode(x, segs, fmt, 64)
    clean = x.clone()
    clean[170] = 0.0
    want, _ = encode_ref(clean, segs, fmt, 64)
    at = record_bytes(64, fmt) + record_bytes(36, fmt) + record_bytes(64, fmt)
    rec = record_bytes(13, fmt)
    got = bytes(buf.numpy())
    assert got[:at] == want[:at] and got[at + rec:] == want[at + rec:]
    zero = {"int8": 0x00, "int4": 0x77}[fmt]
    assert got[at:at + rec] == struct.pack("<I", SENTINEL) + bytes([zero] * (rec - 4))
    for od in DTYPES:
        out = torch.full((477,), 5.0, dtype=od)
        with pytest.raises(_tagc.NonFiniteError, match="NaN/Inf weights.*gather exactly"):
            _tagc.wq_decode(out, buf, segs, fmt, 64)
        assert torch.equal(out, torch.full((477,), 5.0, dtype=od))


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_messages_are_refused_untouched(fmt: str) -> None:
    segs = [100, 0, 50]
    x = weights(150, seed=6)
    clean = encode(x, segs, fmt, 64)
    second = record_bytes(64, fmt)  # the second record of segment 0
    cases = []
    for byte in ({"int8": (0x80,), "int4": (0x0F, 0xF0, 0xFF)}[fmt]):
        b = clean.clone()
        b[second + 4 + 3] = byte
        cases.append(b)
    # NaNs that are not the sentinel, +-Inf, -1, -2^-149, FLT_MAX (qmax * s overflows)
    for scale in (0x7FC00000, 0xFFC0FFEE, 0x7FC0FFEF, 0x7F800000, 0xFF800000, 0xBF800000,
                  0x80000001, 0x7F7FFFFF):
        b = clean.clone()
        b[second:second + 4] = torch.tensor(list(struct.pack("<I", scale)), dtype=torch.uint8)
        cases.append(b)
    b = cases[0].clone()  # a sentinel elsewhere does not hide the corruption
    b[:4] = torch.tensor(list(struct.pack("<I", SENTINEL)), dtype=torch.uint8)
    cases.append(b)
    for b in cases:
        for od in DTYPES:
            out = torch.full((150,), 5.0, dtype=od)
            with pytest.raises(ValueError, match="invalid scale") as info:
                _tagc.wq_decode(out, b, segs, fmt, 64)
            assert not isinstance(info.value, _tagc.NonFiniteError)
            assert torch.equal(out, torch.full((150,), 5.0, dtype=od))


@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_scales_accepted(fmt: str) -> None:
    """The largest scale with qmax * s <= FLT_MAX, 0 and -0 are scales; an odd
    int4 block's pad nibble is not a code and is not checked."""
    segs = [3]
    buf = encode(torch.tensor([1.0, -2.0, 3.0]), segs, fmt, 8)
    top = torch.tensor(FLT_MAX / QMAX[fmt], dtype=torch.float64)
    top = torch.tensor(float(top), dtype=torch.float32)
    while float(top) * QMAX[fmt] > FLT_MAX:
        top = torch.nextafter(top, torch.zeros(()))
    for s in (float(top), 0.0, -0.0):
        b = buf.clone()
        b[:4] = torch.tensor(list(struct.pack("<f", s)), dtype=torch.uint8)
        out = decode(b, segs, 3, fmt, 8)
        assert torch.isfinite(out).all()
    if fmt == "int4":
        b = buf.clone()
        b[-1] |= 0xF0
        assert torch.equal(decode(b, segs, 3, fmt, 8), decode(buf, segs, 3, fmt, 8))


def test_huge_and_tiny_values() -> None:
    """Near FLT_MAX the scale is nudged so qmax * s stays finite; blocks below
    qmax * FLT_MIN get scale 0 and decode to zeros."""
    x = torch.tensor([3.4e38, -3.4e38, 1.0, 1e-39, 0.0, 1e-44])
    for fmt in FORMATS:
        buf = encode(x, [3, 3], fmt, 4)
        want, deq = encode_ref(x, [3, 3], fmt, 4)
        assert bytes(buf.numpy()) == want
        out = decode(buf, [3, 3], 6, fmt, 4)
        assert torch.isfinite(out).all() and same_bits(out, deq)
        assert torch.equal(out[3:], torch.zeros(3))


def test_unaligned_buffers() -> None:
    segs = [33, 0, 100]
    x = weights(133, seed=4)
    want, deq = encode_ref(x, segs, "int8", 16)
    big = torch.zeros(len(want) + 3, dtype=torch.uint8)
    _tagc.wq_encode(big[3:], x, segs, "int8", 16)
    assert bytes(big[3:].numpy()) == want
    out = torch.zeros(134)
    _tagc.wq_decode(out[1:], big[3:], segs, "int8", 16)
    assert same_bits(out[1:], deq)


def _f(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def _u8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


NB = 4 + 10  # wq_bytes([10], "int8", 256)
BAD = [
    (lambda: _tagc.wq_bytes([10], "sign", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_bytes([10], "ternary", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_bytes([10], "int3", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_bytes([10], 8, 256), ValueError, "'format'"),
    (lambda: _tagc.wq_bytes([10], "int8", 0), ValueError, "'block'"),
    (lambda: _tagc.wq_bytes([10], "int8", 65537), ValueError, "'block'"),
    (lambda: _tagc.wq_bytes([10], "int8", 2.0), TypeError, "'block'"),
    (lambda: _tagc.wq_bytes([10, -1], "int8", 256), ValueError, "'segs'"),
    (lambda: _tagc.wq_bytes([2 ** 30, 2 ** 30], "int8", 256), ValueError, "'segs'"),
    (lambda: _tagc.wq_bytes([1.0], "int8", 256), TypeError, "'segs'"),
    (lambda: _tagc.wq_bytes([True], "int8", 256), TypeError, "'segs'"),
    (lambda: _tagc.wq_bytes(10, "int8", 256), TypeError, "'segs'"),
    (lambda: _tagc.wq_bytes(torch.tensor([10], dtype=torch.int32), "int8", 256), TypeError,
     "'segs'"),
    (lambda: _tagc.wq_bytes(torch.tensor([10.0]), "int8", 256), TypeError, "'segs'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10, torch.float16), [10], "int8", 256), TypeError,
     "'src'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10, torch.float64), [10], "int8", 256), TypeError,
     "'src'"),
    (lambda: _tagc.wq_encode(_f(NB), _f(10), [10], "int8", 256), TypeError, "'buf'"),
    (lambda: _tagc.wq_encode(_u8(NB - 1), _f(10), [10], "int8", 256), ValueError, "'buf'"),
    (lambda: _tagc.wq_encode(_u8(NB + 1), _f(10), [10], "int8", 256), ValueError, "'buf'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [9], "int8", 256), ValueError, "'segs' sums to 9"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [11, -1], "int8", 256), ValueError, "'segs'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [10], "ternary", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [10], "sign", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [10], "int8", 0), ValueError, "'block'"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(20)[::2], [10], "int8", 256), TypeError, "contiguous"),
    (lambda: _tagc.wq_encode(_u8(2 * NB)[::2], _f(10), [10], "int8", 256), TypeError,
     "contiguous"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10).requires_grad_(), [10], "int8", 256), TypeError,
     "src"),
    (lambda: _tagc.wq_encode(_u8(NB), _f(10), [10], "int8", 256, status_out=_f(1)), TypeError,
     "'status_out'"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB - 1), [10], "int8", 256), ValueError, "'buf'"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB + 1), [10], "int8", 256), ValueError, "'buf'"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB), [4, 5], "int8", 256), ValueError, "'segs' sums"),
    (lambda: _tagc.wq_decode(_f(10, torch.float16), _u8(NB), [10], "int8", 256), TypeError,
     "'out'"),
    (lambda: _tagc.wq_decode(_f(10), _f(NB), [10], "int8", 256), TypeError, "'buf'"),
    (lambda: _tagc.wq_decode(_f(20)[::2], _u8(NB), [10], "int8", 256), TypeError, "contiguous"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB), [10], "sign", 256), ValueError, "'format'"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB), [10], "int8", -3), ValueError, "'block'"),
    (lambda: _tagc.wq_decode(_f(10), _u8(NB), "abc", "int8", 256), TypeError, "'segs'"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_raise(case: int) -> None:
    fn, exc, text = BAD[case]
    with pytest.raises(exc, match=text):
        fn()


def test_bad_inputs_write_nothing() -> None:
    x = weights(10, seed=1)
    buf = torch.full((NB,), 3, dtype=torch.uint8)
    for segs, fmt, block in (([9], "int8", 256), ([10], "ternary", 256), ([10], "int8", 0),
                             ([5, 6], "int8", 256)):
        with pytest.raises(ValueError):
            _tagc.wq_encode(buf, x, segs, fmt, block)
        assert bool((buf == 3).all())
    out = torch.full((10,), 3.0)
    good = encode(x, [10], "int8", 256)
    with pytest.raises(ValueError):
        _tagc.wq_decode(out, good, [4, 5], "int8", 256)
    assert bool((out == 3).all())


def test_overlapping_arguments_raise() -> None:
    g = torch.zeros(64)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.wq_encode(g.view(torch.uint8)[40:40 + 20], g[8:24], [16], "int8", 16)
    segs = torch.tensor([16], dtype=torch.int64)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.wq_decode(g[:16], g.view(torch.uint8)[60:60 + 20], [16], "int8", 16)
    with pytest.raises(ValueError, match="overlap in memory"):
        _tagc.wq_decode(segs.view(torch.float32)[:2], _u8(20), segs, "int8", 16)


def test_signatures() -> None:
    assert str(inspect.signature(_tagc.wq_bytes)) == "(segs, format, block)"
    assert str(inspect.signature(_tagc.wq_encode)) == \
        "(buf, src, segs, format, block, *, stream=0, status_out=None)"
    assert str(inspect.signature(_tagc.wq_decode)) == \
        "(out, buf, segs, format, block, *, stream=0, status_out=None)"
