"""Coded pairs (the `auto` transport's wire format) against an independent reference.

The reference below writes and reads Elias-Fano, bitmap and dense messages with
plain Python integers and numpy bit arrays, from the layout in csrc/tagc.h; it
validates a received message by the same rules in its own words.  Nothing in the
reference calls `_tagc`.
"""
from typing import List, Optional, Tuple

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.codec

CODINGS = ("ef", "bitmap", "dense")
DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------- reference
def low_bits_ref(n: int, k: int) -> int:
    """Largest l with k * 2^l <= n (0 when k == 0)."""
    if k == 0:
        return 0
    l = 0
    while k * 2 ** (l + 1) <= n:
        l += 1
    return l


def value_bytes(val: torch.Tensor) -> bytes:
    return val.contiguous().view(torch.uint8).numpy().tobytes()


def size_ref(n: int, k: int, dtype: torch.dtype, coding: str) -> int:
    """Bytes of a message, from the layout."""
    if k == 0:
        return 0
    vs = 4 if dtype == torch.float32 else 2
    if coding == "dense":
        return n * vs
    if coding == "bitmap":
        return -(-n // 8) + k * vs
    l = low_bits_ref(n, k)
    return -(-k * l // 8) + -(-(k + (n - 1) // 2 ** l + 1) // 8) + k * vs


def cheapest_ref(n: int, k: int, dtype: torch.dtype) -> str:
    """The coding of fewest bytes by :func:`size_ref`; ties go to the earlier coding
    of CODINGS (EF, then bitmap), as csrc/tagc.h specifies."""
    sizes = [size_ref(n, k, dtype, c) for c in CODINGS]
    return CODINGS[sizes.index(min(sizes))]


def bits_to_bytes(bits: List[int]) -> bytes:
    """LSB-first packing of a 0/1 list, zero-padded to whole bytes."""
    arr = np.array(bits + [0] * (-len(bits) % 8), dtype=np.uint8)
    return np.packbits(arr, bitorder="little").tobytes()


def pack_ref(idx: torch.Tensor, val: torch.Tensor, n: int, coding: str) -> bytes:
    pos = [int(p) for p in idx]
    k = len(pos)
    if k == 0:
        return b""
    vs = val.element_size()
    if coding == "dense":
        full = torch.zeros(n, dtype=val.dtype)
        full[idx.long()] = val
        return value_bytes(full)
    if coding == "bitmap":
        bits = [0] * n
        for p in pos:
            bits[p] = 1
        return bits_to_bytes(bits) + value_bytes(val)
    l = low_bits_ref(n, k)
    low: List[int] = []
    for p in pos:
        low += [(p >> b) & 1 for b in range(l)]
    upper = [0] * (k + (n - 1) // 2 ** l + 1)
    for j, p in enumerate(pos):
        upper[(p >> l) + j] = 1
    out = bits_to_bytes(low) + bits_to_bytes(upper) + value_bytes(val)
    assert len(out) == size_ref(n, k, val.dtype, coding) and vs in (2, 4)
    return out


def positions_ref(buf: bytes, n: int, k: int, vs: int, coding: str) -> Optional[List[int]]:
    """The positions a message names, or None when it is not a valid message."""
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little").tolist()
    if coding == "bitmap":
        bm = bits[:-(-n // 8) * 8]
        pos = [i for i, b in enumerate(bm) if b]
        return pos if len(pos) == k and all(p < n for p in pos) else None
    l = low_bits_ref(n, k)
    lo_bits = -(-k * l // 8) * 8
    nup = k + (n - 1) // 2 ** l + 1
    low, upper = bits[:lo_bits], bits[lo_bits:lo_bits + -(-nup // 8) * 8]
    if any(low[k * l:]) or any(upper[nup:]):
        return None
    ones = [i for i, b in enumerate(upper) if b]
    if len(ones) != k:
        return None
    pos = []
    for j, b in enumerate(ones):
        lo = sum(low[j * l + i] << i for i in range(l))
        pos.append(((b - j) << l) | lo)
    ok = all(p < n for p in pos) and all(b > a for a, b in zip(pos, pos[1:]))
    return pos if ok else None


def unpack_ref(out: torch.Tensor, buf: bytes, k: int, dtype: torch.dtype,
               coding: str) -> bool:
    """out += the message (True), or out untouched and False when it is invalid."""
    n, vs = out.numel(), (4 if dtype == torch.float32 else 2)
    if k == 0:
        return True
    vals = torch.frombuffer(bytearray(buf[len(buf) - (n if coding == "dense" else k) * vs:]),
                            dtype=dtype).float()
    if coding == "dense":
        out += vals
        return True
    pos = positions_ref(buf, n, k, vs, coding)
    if pos is None:
        return False
    for p, v in zip(pos, vals):  # one at a time, in position order
        out[p] += v
    return True


def random_pairs(n: int, k: int, dtype: torch.dtype, gen: torch.Generator
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32)
    val = torch.randn(k, generator=gen).to(dtype)
    return idx, val


def pack(idx: torch.Tensor, val: torch.Tensor, n: int, coding: str) -> torch.Tensor:
    import _tagc
    buf = torch.full((_tagc.pairs_bytes(n, idx.numel(), val.dtype, coding),), 0xA5,
                     dtype=torch.uint8)
    _tagc.pairs_pack(buf, idx, val, n, coding)
    return buf


# ----------------------------------------------------------------------------- tests
SIZES = [(1, 0), (1, 1), (2, 1), (7, 3), (8, 8), (9, 1), (64, 1), (65, 64), (1000, 13),
         (1000, 250), (1001, 999), (4096, 51), (100_003, 1251), (100_003, 10_001)]


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("coding", CODINGS)
def test_pack_bytes_and_unpack_match_reference(n, k, dtype, coding):
    import _tagc
    gen = torch.Generator().manual_seed(n * 7 + k)
    idx, val = random_pairs(n, k, dtype, gen)
    assert _tagc.pairs_bytes(n, k, dtype, coding) == size_ref(n, k, dtype, coding)
    buf = pack(idx, val, n, coding)
    if n <= 10_000 or coding != "bitmap":
        assert buf.numpy().tobytes() == pack_ref(idx, val, n, coding)
    out = torch.randn(n, generator=gen)
    want = out.clone()
    want.index_add_(0, idx.long(), val.float())  # positions distinct: order-free
    _tagc.pairs_unpack_add(out, buf, k, dtype, coding)
    assert torch.equal(out, want)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 64, 80, 1000, 2 ** 22, 2 ** 31 - 1])
def test_sizes_and_cheapest(n):
    import _tagc
    for k in sorted(k for k in {0, 1, n // 80, n // 20, n // 10, n // 4, n // 2, n - 1, n}
                    if 0 <= k <= n):
        assert _tagc.pairs_bytes(n, k, torch.float32, "ef") == size_ref(n, k, torch.float32, "ef")
        for dt in DTYPES:
            assert _tagc.pairs_cheapest(n, k, dt) == cheapest_ref(n, k, dt)


def test_cheapest_is_the_shortest_real_message():
    """Every (n, k) with n <= 48, both value dtypes: the codec's choice is the coding
    whose message, written by the reference packer, is the shortest of the three
    (ties: EF, then bitmap), and ``pairs_bytes`` gives that message's real length.
    Exhaustive where the crossovers and ties of small shards lie (the sizes above
    sample k); the lengths are measured, not taken from :func:`size_ref`."""
    import _tagc
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 49):
        for k in range(n + 1):
            for dt in DTYPES:
                idx, val = random_pairs(n, k, dt, gen)
                lens = [len(pack_ref(idx, val, n, c)) for c in CODINGS]
                got = _tagc.pairs_cheapest(n, k, dt)
                assert got == CODINGS[lens.index(min(lens))], (n, k, dt, lens, got)
                assert _tagc.pairs_bytes(n, k, dt, got) == min(lens), (n, k, dt, got)


def test_ef_bits_per_position_bound():
    """EF spends at most 2 + log2(n/k) bits per position (tagc.h)."""
    import _tagc
    for n, k in [(2 ** 22, 52429), (2 ** 24, 1677722), (10_000, 3), (999, 500)]:
        bits = 8 * (_tagc.pairs_bytes(n, k, torch.float32, "ef") - 4 * k)
        assert bits / k <= 2 + np.log2(n / k) + 16 / k


def test_huge_shard_roundtrip():
    import _tagc
    n, k = 2 ** 24 + 3, 209_716
    gen = torch.Generator().manual_seed(5)
    idx, val = random_pairs(n, k, torch.float32, gen)
    for coding in CODINGS:
        buf = pack(idx, val, n, coding)
        out = torch.zeros(n)
        _tagc.pairs_unpack_add(out, buf, k, torch.float32, coding)
        assert torch.equal(out[idx.long()], val) and int((out != 0).sum()) == int((val != 0).sum())


def test_extreme_positions():
    """First and last positions, every low bit set: what the bit arithmetic can get wrong."""
    import _tagc
    n = 2 ** 20 + 1
    idx = torch.tensor([0, 2 ** 19 - 1, 2 ** 20 - 1, 2 ** 20], dtype=torch.int32)
    val = torch.tensor([1.0, -2.0, 3.0, float("inf")])
    for coding in CODINGS:
        buf = pack(idx, val, n, coding)
        assert buf.numpy().tobytes() == pack_ref(idx, val, n, coding)
        out = torch.zeros(n)
        _tagc.pairs_unpack_add(out, buf, 4, torch.float32, coding)
        assert out[idx.long()].tolist() == val.tolist()  # values are data: inf passes


@pytest.mark.parametrize("coding", CODINGS)
def test_pack_refuses_bad_positions_writing_nothing(coding):
    import _tagc
    val = torch.ones(3)
    for bad in ([0, 0, 1], [2, 1, 3], [0, 1, 10], [-1, 2, 3]):
        buf = torch.full((_tagc.pairs_bytes(10, 3, torch.float32, coding),), 7,
                         dtype=torch.uint8)
        with pytest.raises(ValueError, match="ascending"):
            _tagc.pairs_pack(buf, torch.tensor(bad, dtype=torch.int32), val, 10, coding)
        assert bool((buf == 7).all())


def test_bad_arguments_raise():
    import _tagc
    idx, val = torch.tensor([1, 4], dtype=torch.int32), torch.ones(2)
    with pytest.raises(ValueError, match="coding"):
        _tagc.pairs_bytes(10, 2, torch.float32, "rle")
    with pytest.raises(ValueError, match="'k'"):
        _tagc.pairs_bytes(10, 11, torch.float32, "ef")
    with pytest.raises(TypeError, match="value_dtype"):
        _tagc.pairs_cheapest(10, 2, torch.float16)
    with pytest.raises(ValueError, match="'n'"):
        _tagc.pairs_pack(torch.empty(100, dtype=torch.uint8), idx, val, 1, "ef")
    with pytest.raises(ValueError, match="buf"):
        _tagc.pairs_pack(torch.empty(2, dtype=torch.uint8), idx, val, 10, "ef")
    with pytest.raises(ValueError, match="val"):
        _tagc.pairs_pack(torch.empty(100, dtype=torch.uint8), idx, torch.ones(3), 10, "ef")
    with pytest.raises(TypeError, match="idx"):
        _tagc.pairs_pack(torch.empty(100, dtype=torch.uint8), idx.long(), val, 10, "ef")
    buf = pack(idx, val, 10, "ef")
    with pytest.raises(ValueError, match="buf"):  # a message of another size
        _tagc.pairs_unpack_add(torch.zeros(10), buf[:-1], 2, torch.float32, "ef")
    with pytest.raises(ValueError, match="buf"):
        _tagc.pairs_unpack_add(torch.zeros(11), torch.cat([buf, buf[:1]]), 2, torch.float32,
                               "ef")


@pytest.mark.parametrize("coding", ["ef", "bitmap"])
@pytest.mark.parametrize("n,k", [(9, 1), (100, 3), (1000, 13), (1000, 400)])
def test_corrupt_messages_match_reference_validity(coding, n, k):
    """Random bit flips: the codec accepts exactly the messages the reference
    accepts (then adds the same values), and otherwise leaves out untouched."""
    import _tagc
    gen = torch.Generator().manual_seed(n + k)
    idx, val = random_pairs(n, k, torch.float32, gen)
    clean = pack(idx, val, n, coding).numpy().tobytes()
    rng = np.random.default_rng(n * k)
    pos_bytes = len(clean) - 4 * k
    rejected = 0
    for trial in range(300):
        b = bytearray(clean)
        for _ in range(1 + trial % 3):
            bit = int(rng.integers(pos_bytes * 8))
            b[bit // 8] ^= 1 << (bit % 8)
        out = torch.randn(n, generator=gen)
        ref = out.clone()
        ok_ref = unpack_ref(ref, bytes(b), k, torch.float32, coding)
        buf = torch.frombuffer(b, dtype=torch.uint8)
        before = out.clone()
        try:
            _tagc.pairs_unpack_add(out, buf, k, torch.float32, coding)
            ok = True
        except ValueError as exc:
            assert "corrupt" in str(exc) or "inconsistent" in str(exc)
            ok = False
        assert ok == ok_ref
        assert torch.equal(out, ref if ok else before)
        rejected += not ok
    assert rejected > 0


def test_k0_is_empty():
    import _tagc
    for coding in CODINGS:
        assert _tagc.pairs_bytes(7, 0, torch.float32, coding) == 0
        out = torch.ones(7)
        _tagc.pairs_pack(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int32),
                         torch.empty(0), 7, coding)
        _tagc.pairs_unpack_add(out, torch.empty(0, dtype=torch.uint8), 0, torch.float32, coding)
        assert torch.equal(out, torch.ones(7))
