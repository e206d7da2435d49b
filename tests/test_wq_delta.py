"""The weights' change on the gather codes (`_tagc.wq_delta_bytes` / `wq_delta_encode` /
`wq_delta_decode`, csrc/tagc.h) against a pure-torch reference: test_wq's independent
encoder of the wq layout applied to ``src - base`` (fp32 differences), a flag byte, and
``ref = dtype(ref + decoded)``.  Nothing here calls `_tagc` to compute an expected value.
"""
from __future__ import annotations

import inspect
import struct

import pytest
import torch

from test_wq import DTYPES, FORMATS, SEGS, SENTINEL, bytes_ref, encode_ref, record_bytes, \
    same_bits, weights

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec


def delta_ref(src: torch.Tensor, sent: torch.Tensor, base: torch.Tensor, segs, fmt: str,
              block: int):
    """(message bytes, decoded change or None) of the owner's side."""
    if same_bits(src, sent):
        return bytes(bytes_ref(segs, fmt, block) + 1), None
    msg, deq = encode_ref(src.float() - base.float(), segs, fmt, block)
    return msg + b"\x01", deq


def encode(src, sent, base, segs, fmt, block) -> torch.Tensor:
    buf = torch.full((_tagc.wq_delta_bytes(segs, fmt, block),), 0xAB, dtype=torch.uint8)
    _tagc.wq_delta_encode(buf, src, sent, base, segs, fmt, block)
    return buf


def triple(n: int, seed: int, dtype: torch.dtype):
    """(src, sent, base): the shard, the one sent before, the held weights (close)."""
    src = weights(n, seed, dtype)
    base = (src.float() + 1e-2 * weights(n, seed + 1)).to(dtype)
    return src, weights(n, seed + 2, dtype), base


def test_signatures_and_bytes() -> None:
    assert str(inspect.signature(_tagc.wq_delta_bytes)) == "(segs, format, block)"
    assert str(inspect.signature(_tagc.wq_delta_encode)) == \
        "(buf, src, sent, base, segs, format, block, *, stream=0, status_out=None)"
    assert str(inspect.signature(_tagc.wq_delta_decode)) == \
        "(out, ref, buf, segs, format, block, *, stream=0, status_out=None)"
    for segs in SEGS:
        for fmt in FORMATS:
            for block in (1, 5, 64, 256):
                assert _tagc.wq_delta_bytes(segs, fmt, block) == bytes_ref(segs, fmt, block) + 1


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("si", range(len(SEGS)))
@pytest.mark.parametrize("block", [1, 5, 64])
@pytest.mark.parametrize("dt", DTYPES)
def test_changed_shard_matches_reference(fmt: str, si: int, block: int,
                                         dt: torch.dtype) -> None:
    segs = SEGS[si]
    n = sum(segs)
    src, sent, base = triple(n, 3 + si, dt)
    want, deq = delta_ref(src, sent, base, segs, fmt, block)
    buf = encode(src, sent, base, segs, fmt, block)
    assert bytes(buf.numpy()) == want
    assert same_bits(sent, src)  # remembered (n == 0: nothing to remember)
    ref = base.clone()
    out = torch.full((n,), 5.0, dtype=dt)
    _tagc.wq_delta_decode(out, ref, buf, segs, fmt, block)
    expect = base if deq is None else (base.float() + deq).to(dt)
    assert same_bits(ref, expect) and same_bits(out, expect)
    inplace = base.clone()
    _tagc.wq_delta_decode(None, inplace, buf, segs, fmt, block)
    assert same_bits(inplace, expect)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("offset", range(9))
@pytest.mark.parametrize("segs", [[1, 2, 700], [3], [0, 1, 0, 40, 64, 1000, 7], [2049]],
                         ids=("tiny-head", "three", "mixed", "long"))
def test_remembered_copy_at_every_alignment(dt: torch.dtype, offset: int, segs) -> None:
    """The copy of the shard into ``sent`` at every alignment of ``sent`` (its start
    ``offset`` values into a larger buffer), first blocks shorter and longer than the
    way to a 32-byte boundary: exactly the shard, nothing written beside it, and the
    message the reference's."""
    n = sum(segs)
    src, _, base = triple(n, 40 + offset, dt)
    room = torch.full((n + 24,), -3.0, dtype=dt)
    sent = room[offset:offset + n]
    want, _ = delta_ref(src, sent, base, segs, "int4", 64)
    buf = encode(src, sent, base, segs, "int4", 64)
    assert bytes(buf.numpy()) == want
    assert same_bits(sent, src)
    assert bool((room[:offset] == -3.0).all()) and bool((room[offset + n:] == -3.0).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dt", DTYPES)
def test_unchanged_shard_sends_zeros_and_decodes_to_ref(fmt: str, dt: torch.dtype) -> None:
    segs = [100, 0, 77]
    src, _, base = triple(177, 8, dt)
    sent = src.clone()
    buf = encode(src, sent, base, segs, fmt, 64)
    assert (buf == 0).all() and same_bits(sent, src)
    ref = base.clone()
    out = torch.full((177,), 5.0, dtype=dt)
    _tagc.wq_delta_decode(out, ref, buf, segs, fmt, 64)
    assert same_bits(ref, base) and same_bits(out, base)
    # the codes of an unflagged message are not read
    buf[:4] = torch.tensor(list(struct.pack("<I", 0x7F800000)), dtype=torch.uint8)
    _tagc.wq_delta_decode(out, ref, buf, segs, fmt, 64)
    assert same_bits(out, base)


def test_the_change_test_is_bitwise() -> None:
    """-0 and +0 differ (coded: a change of 0); a NaN equals itself (not coded)."""
    segs = [64]
    src = torch.zeros(64)
    sent = src.clone()
    sent[7] = -0.0
    buf = encode(src, sent, src.clone(), segs, "int4", 64)
    assert buf[-1] == 1 and bytes(buf[:-1].numpy()) == encode_ref(torch.zeros(64), segs,
                                                                   "int4", 64)[0]
    src[3] = float("nan")
    sent = src.clone()
    assert (encode(src, sent, src.clone(), segs, "int4", 64) == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dt", DTYPES)
def test_closed_loop_tracks_the_weights(fmt: str, dt: torch.dtype) -> None:
    """Owner and receiver stay the same bytes over steps, and ref trails the weights by a
    fraction of one step's change, not of the weights (the loop is closed)."""
    segs, block = [300, 45], 64
    w = weights(345, 20, dt)
    ref = w.clone()
    mirror = w.clone()
    sent = w.clone()
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        step = 1e-3 * torch.randn(345, generator=g)
        w = (w.float() + step).to(dt)
        buf = encode(w, sent, mirror, segs, fmt, block)
        out = torch.empty_like(w)
        _tagc.wq_delta_decode(None, mirror, buf, segs, fmt, block)
        _tagc.wq_delta_decode(out, ref, buf, segs, fmt, block)
        assert same_bits(ref, mirror) and same_bits(out, ref)
    err = (ref.float() - w.float()).abs().max().item()
    assert err < {"int8": 0.05, "int4": 0.5}[fmt] * 1e-3 * 5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dt", DTYPES)
def test_nonfinite_change_is_refused_untouched(fmt: str, dt: torch.dtype) -> None:
    segs = [100, 77]
    src, sent, base = triple(177, 9, dt)
    src[130] = float("nan")
    buf = encode(src, sent, base, segs, fmt, 64)
    at = record_bytes(64, fmt) + record_bytes(36, fmt)
    assert struct.unpack("<I", bytes(buf[at:at + 4].numpy()))[0] == SENTINEL
    ref = base.clone()
    out = torch.full((177,), 5.0, dtype=dt)
    with pytest.raises(_tagc.NonFiniteError, match="gather exactly"):
        _tagc.wq_delta_decode(out, ref, buf, segs, fmt, 64)
    assert same_bits(ref, base) and (out == 5.0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_messages_are_refused_untouched(fmt: str) -> None:
    segs = [100, 50]
    src, sent, base = triple(150, 10, torch.float32)
    clean = encode(src, sent, base, segs, fmt, 64)
    cases = []
    for flag in (2, 0x80, 0xFF):
        b = clean.clone()
        b[-1] = flag
        cases.append(b)
    b = clean.clone()
    b[record_bytes(64, fmt):record_bytes(64, fmt) + 4] = torch.tensor(
        list(struct.pack("<I", 0xBF800000)), dtype=torch.uint8)  # scale -1
    cases.append(b)
    b = clean.clone()
    b[4 + 3] = {"int8": 0x80, "int4": 0xFF}[fmt]
    cases.append(b)
    for b in cases:
        ref = base.clone()
        out = torch.full((150,), 5.0)
        with pytest.raises(ValueError, match="invalid scale") as info:
            _tagc.wq_delta_decode(out, ref, b, segs, fmt, 64)
        assert not isinstance(info.value, _tagc.NonFiniteError)
        assert same_bits(ref, base) and (out == 5.0).all()


def test_bad_arguments_raise() -> None:
    segs = [10, 6]
    src, sent, base = triple(16, 11, torch.float32)
    good = _tagc.wq_delta_bytes(segs, "int4", 8)
    buf = torch.empty(good, dtype=torch.uint8)
    with pytest.raises(TypeError, match="same dtype"):
        _tagc.wq_delta_encode(buf, src, sent.bfloat16(), base, segs, "int4", 8)
    with pytest.raises(ValueError, match="base"):
        _tagc.wq_delta_encode(buf, src, sent, base[:15], segs, "int4", 8)
    with pytest.raises(ValueError, match="wq_delta_bytes"):
        _tagc.wq_delta_encode(buf[:-1], src, sent, base, segs, "int4", 8)
    with pytest.raises(ValueError, match="sums to"):
        _tagc.wq_delta_encode(buf, src, sent, base, [10, 5], "int4", 8)
    with pytest.raises(ValueError):
        _tagc.wq_delta_encode(buf, src, sent, base, segs, "ternary", 8)
    with pytest.raises(ValueError):
        _tagc.wq_delta_encode(buf, src, src, base, segs, "int4", 8)  # shared memory
    with pytest.raises(TypeError):
        _tagc.wq_delta_encode(buf, src.double(), sent, base, segs, "int4", 8)
    _tagc.wq_delta_encode(buf, src, sent, base, segs, "int4", 8)
    with pytest.raises(ValueError, match="wq_delta_bytes"):
        _tagc.wq_delta_decode(None, base.clone(), buf[:-1], segs, "int4", 8)
    with pytest.raises(TypeError, match="same dtype"):
        _tagc.wq_delta_decode(torch.empty(16, dtype=torch.bfloat16), base.clone(), buf, segs,
                              "int4", 8)
    ref = base.clone()
    with pytest.raises(ValueError):
        _tagc.wq_delta_decode(ref, ref, buf, segs, "int4", 8)  # in place is out=None
    with pytest.raises(ValueError):
        _tagc.wq_delta_decode(None, ref, buf, segs, "int4", 0)
    assert same_bits(ref, base)


def test_empty_shard() -> None:
    e = torch.empty(0)
    buf = torch.full((1,), 7, dtype=torch.uint8)
    _tagc.wq_delta_encode(buf, e, e.clone(), e.clone(), [], "int4", 64)
    assert buf.tolist() == [0]
    _tagc.wq_delta_decode(torch.empty(0), torch.empty(0), buf, [0], "int8", 64)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_shard(fmt: str) -> None:
    """2^24 + 3 values in a few segments (blocks not dividing them)."""
    segs = [(1 << 23) + 1, 0, 4095, (1 << 23) - 4093]
    n = sum(segs)
    src, sent, base = triple(n, 12, torch.float32)
    want, deq = delta_ref(src, sent, base, segs, fmt, 256)
    buf = encode(src, sent, base, segs, fmt, 256)
    assert bytes(buf.numpy()) == want
    expect = base + deq
    out = torch.empty(n)
    _tagc.wq_delta_decode(out, base, buf, segs, fmt, 256)
    assert same_bits(out, expect) and same_bits(base, expect)
