"""4-bit codes (``_tagc.fp4_*``: E2M1 values, E8M0 block scales) and the seeded block
Hadamard rotation (``_tagc.rht``), against a numpy reference of csrc/fp4.h's rules, and
the CUDA twins (cuda/fp4.cu) run on the CPU through the emulation (cuda/emu) against
the C ops, bit for bit."""
from __future__ import annotations

import ctypes as C
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SIGN_STREAM, SR_STREAM = 16, 17
ROTATE, STOCHASTIC = 1, 2


# ----------------------------------------------------------------------------- reference
def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (tagc_portable.h), on uint64 arrays."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def table_seed(seed: int, table: int) -> np.uint64:
    with np.errstate(over="ignore"):
        return mix64(np.array([seed], np.uint64) + np.uint64(table + 1) * GOLDEN)[0]


def hash_(p: np.ndarray, ts: np.uint64) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(ts + p.astype(np.uint64) * GOLDEN)


def flip_bits(seed: int, idx: np.ndarray) -> np.ndarray:
    h = hash_(idx >> 6, table_seed(seed, SIGN_STREAM))
    return ((h >> (idx & 63).astype(np.uint64)) & np.uint64(1)).astype(bool)


def uniforms(seed: int, idx: np.ndarray) -> np.ndarray:
    h = hash_(idx >> 1, table_seed(seed, SR_STREAM))
    w = (h >> (np.uint64(32) * (idx & 1).astype(np.uint64))) & np.uint64(0xFFFFFFFF)
    return (w >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)


def norm(l: int) -> np.float32:
    p = np.float32(2.0 ** -(l // 2))
    return np.float32(np.float32(0.70710678118654752) * p) if l & 1 else p


def fwht(x: np.ndarray) -> np.ndarray:
    """Rows of x (float32, power-of-two width): the butterflies a + b, a - b."""
    rows, b = x.shape
    h = 1
    while h < b:
        y = x.reshape(rows, b // (2 * h), 2, h)
        x = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2).reshape(rows, b)
        h *= 2
    return x


def rotate(x: np.ndarray, block: int, seed: int, inverse: bool) -> np.ndarray:
    """The blockwise rotation of x (float32), as tagc.h defines it."""
    x = x.astype(np.float32).copy()
    n, l = x.size, block.bit_length() - 1
    flips = flip_bits(seed, np.arange(n, dtype=np.int64))
    if not inverse:
        x = np.where(flips, -x, x)
    whole = n // block * block
    if whole:
        x[:whole] = (fwht(x[:whole].reshape(-1, block)) * norm(l)).reshape(-1)
    if inverse:
        x = np.where(flips, -x, x)
    return x.astype(np.float32)


LEVEL2 = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)


def scale_bytes(w: np.ndarray, block: int) -> np.ndarray:
    n = w.size
    nb = -(-n // block)
    pad = np.zeros(nb * block, np.float32)
    pad[:n] = np.abs(w)
    mx = pad.reshape(nb, block).max(axis=1).view(np.uint32)
    e = (mx >> 23).astype(np.int64)
    b = e - 2 + ((mx & 0x7FFFFF) > 0x400000)
    return np.where(e == 0, 0, np.maximum(b, 0)).astype(np.uint8)


def scale_of(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.uint32)
    bits = np.where(b == 255, 0x7FC00000, np.where(b == 0, 0x00400000, b << 23))
    return bits.astype(np.uint32).view(np.float32)


def values_of(c: np.ndarray) -> np.ndarray:
    m = LEVEL2[c & 7] * np.float32(0.5)
    return np.where(c & 8, -m, m).astype(np.float32)


def ref_encode(v: np.ndarray, block: int, flags: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(the message, what the owner decodes) of v (float32)."""
    n = v.size
    w = rotate(v, block, seed, False) if flags & ROTATE else v
    sb = scale_bytes(w, block)
    per = np.repeat(sb, block)[:n]
    inv = ((254 - per.astype(np.uint32)) << 23).astype(np.uint32).view(np.float32)
    y = (np.abs(w) * inv).astype(np.float32)
    if flags & STOCHASTIC:
        k = sum((y >= np.float32(t)).astype(np.int64) for t in (0.5, 1, 1.5, 2, 3, 4, 6))
        lo = LEVEL2[k] * np.float32(0.5)
        hi = LEVEL2[np.minimum(k + 1, 7)] * np.float32(0.5)
        u = uniforms(seed, np.arange(n, dtype=np.int64))
        k = k + ((y - lo) > u * (hi - lo))
    else:
        k = sum((y > np.float32(t)).astype(np.int64) for t in (0.25, 1.25, 2.5, 5.0)) + \
            sum((y >= np.float32(t)).astype(np.int64) for t in (0.75, 1.75, 3.5))
    c = (k | np.where((w < 0) & (k > 0), 8, 0)).astype(np.uint8)
    nib = np.zeros(n + (n & 1), np.uint8)
    nib[:n] = c
    codes = nib[0::2] | (nib[1::2] << 4)
    return np.concatenate([codes, sb]), ref_decoded(np.concatenate([codes, sb]), n, block,
                                                    flags, seed)


def ref_decoded(msg: np.ndarray, n: int, block: int, flags: int, seed: int) -> np.ndarray:
    cb = (n + 1) // 2
    codes, sb = msg[:cb], msg[cb:]
    c = np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:n]
    d = (values_of(c) * np.repeat(scale_of(sb), block)[:n]).astype(np.float32)
    return rotate(d, block, seed, True) if flags & ROTATE else d


def gradient(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian with a few outliers and exact ties to the code grid's midpoints."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n > 8:
        x[torch.randint(0, n, (n // 50 + 1,), generator=g)] *= 30.0
        x[: n // 4: 7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, 6.0, 0.0]
                                      ).repeat(n)[: len(range(0, n // 4, 7))]
    return x.to(dtype)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy()


def encode(grad: torch.Tensor, res: Optional[torch.Tensor], block: int, flags: int,
           seed: int) -> torch.Tensor:
    buf = torch.full((_tagc.fp4_bytes(grad.numel(), block),), 0xEE, dtype=torch.uint8)
    _tagc.fp4_encode(buf, res, grad, block, seed=seed, rotate=bool(flags & ROTATE),
                     stochastic=bool(flags & STOCHASTIC))
    return buf


# ----------------------------------------------------------------------------- C op
@pytest.mark.parametrize("n", [0, 1, 2, 31, 33, 255, 1000, 4097])
@pytest.mark.parametrize("block", [2, 16, 32, 256])
def test_bytes(n: int, block: int) -> None:
    assert _tagc.fp4_bytes(n, block) == (n + 1) // 2 + -(-n // block)
    assert _tagc.fp4_bytes(n=n, block=block) == _tagc.fp4_bytes(n, block)


@pytest.mark.parametrize("block", [0, 1, 3, 24, 512, -32])
def test_bytes_refuses_bad_blocks(block: int) -> None:
    with pytest.raises(ValueError):
        _tagc.fp4_bytes(10, block)
    with pytest.raises(ValueError):
        _tagc.fp4_bytes(-1, 32)


# (the value's dtype, the residual's): bf16 without one is a gather of bf16 weights
CASES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000, 4097])
@pytest.mark.parametrize("block", [2, 16, 32, 256])
@pytest.mark.parametrize("gd,rd", CASES)
@pytest.mark.parametrize("flags", [0, ROTATE, STOCHASTIC, ROTATE | STOCHASTIC])
def test_encode_decode_match_reference(n: int, block: int, gd: torch.dtype,
                                       rd: Optional[torch.dtype], flags: int) -> None:
    seed = 0x1234_5678_9ABC_DEF0 + n
    grad = gradient(n, gd, seed=n)
    res = None if rd is None else (gradient(n, torch.float32, seed=n + 1) * 0.3).to(rd)
    v = grad.float() + (0 if res is None else res.float())
    r0 = None if res is None else res.clone()
    buf = encode(grad, res, block, flags, seed)
    msg, dec = ref_encode(v.numpy(), block, flags, seed)
    assert np.array_equal(buf.numpy(), msg)
    if res is not None:
        want = torch.from_numpy(v.numpy() - dec).to(rd)
        assert np.array_equal(bits(res), bits(want))
        assert r0 is not None
    base = gradient(n, torch.float32, seed=n + 2)
    out = base.clone()
    _tagc.fp4_decode_add(out, buf, block, seed=seed, rotate=bool(flags & ROTATE))
    assert np.array_equal(bits(out), bits(torch.from_numpy(base.numpy() + dec)))


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> C.CDLL:
    """csrc/fp4.c built here with setup.py's C flags and its generic loops only
    (-DTAGC_QUANT_NO_AVX2: what a CPU without AVX2 runs)."""
    import os
    import shutil
    import subprocess

    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        pytest.skip("no C compiler to build csrc/fp4.c")
    root = Path(__file__).resolve().parents[1] / "csrc"
    so = tmp_path_factory.mktemp("fp4_generic") / "libfp4.so"
    subprocess.run([cc, "-std=c11", "-O3", "-fno-trapping-math", "-fPIC", "-shared",
                    "-DTAGC_QUANT_NO_AVX2", "-I", str(root), str(root / "fp4.c"),
                    str(root / "status.c"), "-o", str(so), "-lm"], check=True)
    dll = C.CDLL(str(so))
    dll.tagc_fp4_encode.restype = C.c_int
    dll.tagc_fp4_encode.argtypes = [C.c_void_p, C.c_int64, C.c_void_p, C.c_int, C.c_void_p,
                                    C.c_int, C.c_int64, C.c_int64, C.c_uint, C.c_uint64]
    dll.tagc_fp4_decode_add.restype = C.c_int
    dll.tagc_fp4_decode_add.argtypes = [C.c_void_p, C.c_int64, C.c_void_p, C.c_int64,
                                        C.c_int64, C.c_uint, C.c_uint64]
    return dll


@pytest.mark.parametrize("flags", [0, ROTATE])
@pytest.mark.parametrize("block", [32, 64, 256])
def test_generic_decoder_adds_the_avx2_values(generic: C.CDLL, block: int, flags: int) -> None:
    """The AVX2 decoder (blocks of 32 and more) and the generic one on random bytes:
    every nibble, the extreme scale bytes (0, 254, NaN's 255), blocks of +6 codes at
    the scale bytes 244 and 245 (whose rotated sums stay finite / reach Inf) and a
    partial last block add the same bits."""
    g = torch.Generator().manual_seed(block + flags)
    for n in (32, 95, 1000, 4099):
        nb = _tagc.fp4_bytes(n, block)
        buf = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
        scales = torch.randint(100, 140, (nb - (n + 1) // 2,), dtype=torch.uint8, generator=g)
        extreme = torch.tensor([0, 254, 255, 244, 245], dtype=torch.uint8)[: len(scales)]
        scales[: len(extreme)] = extreme
        for b in (3, 4):
            buf[b * block // 2:min((b + 1) * block, n) // 2] = 0x77
        buf[(n + 1) // 2:] = scales
        base = gradient(n, torch.float32, seed=n)
        o1, o2 = base.clone(), base.clone()
        _tagc.fp4_decode_add(o1, buf, block, seed=block, rotate=bool(flags & ROTATE))
        st = generic.tagc_fp4_decode_add(o2.data_ptr(), n, buf.data_ptr(), nb, block, flags,
                                         block)
        assert st == 0
        assert np.array_equal(bits(o1), bits(o2)), n


@pytest.mark.parametrize("flags", [0, ROTATE])
@pytest.mark.parametrize("block", [32, 64, 256])
@pytest.mark.parametrize("gd,rd", CASES)
@pytest.mark.parametrize("kind", ["gauss", "nan", "inf", "limit", "near", "tiny", "small"])
def test_generic_loops_write_the_avx2_bytes(generic: C.CDLL, block: int, gd: torch.dtype,
                                            rd: Optional[torch.dtype], kind: str,
                                            flags: int) -> None:
    """The AVX2 loops (blocks of 32 and more, plain or rotated) and the generic ones:
    the same bytes, residual and status, refusals included (a NaN, an Inf or a value
    at the limit of 2^100 in a late block; the largest value taken there; blocks of
    subnormal scale, and of scales 2^-130 .. 2^-119 side by side)."""
    seed = 7 + block
    dtype = {torch.float32: 0, torch.bfloat16: 1}
    for n in (32, 95, 1000, 4099):
        grad = gradient(n, torch.float32, seed=n + block)
        if kind == "tiny":
            grad = grad * 1e-40
        elif kind == "small":
            grad = grad * 2.0 ** -130 * 2.0 ** (torch.arange(n) // 32 % 12)
        elif kind == "near":
            grad[n - 5] = 1.99 * 2.0 ** 99
        elif kind != "gauss":
            grad[n - 5] = {"nan": float("nan"), "inf": float("-inf"), "limit": 2.0 ** 100}[kind]
        grad = grad.to(gd)
        res = None if rd is None else (gradient(n, torch.float32, seed=n + 1) * 0.3).to(rd)
        r1 = None if res is None else res.clone()
        r2 = None if res is None else res.clone()
        nb = _tagc.fp4_bytes(n, block)
        b1, b2 = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)
        try:
            _tagc.fp4_encode(b1, r1, grad, block, seed=seed, rotate=bool(flags & ROTATE))
            st1 = 0
        except _tagc.NonFiniteError:
            st1 = 5
        st2 = generic.tagc_fp4_encode(b2.data_ptr(), nb, None if r2 is None else r2.data_ptr(),
                                      dtype[rd] if rd is not None else 0, grad.data_ptr(),
                                      dtype[gd], n, block, flags, seed)
        assert st1 == st2 == (0 if kind in ("gauss", "near", "tiny", "small") else 5), (n, kind)
        if st1 == 0:  # a refused message's bytes are unspecified
            assert torch.equal(b1, b2), n
        if res is not None:
            assert np.array_equal(bits(r1), bits(r2)), n


@pytest.mark.parametrize("gd,flags", [(torch.float32, ROTATE), (torch.bfloat16, 0)])
def test_two_to_the_24(gd: torch.dtype, flags: int) -> None:
    n, block, seed = 1 << 24, 32, 99
    grad = gradient(n, gd, seed=5)
    res = torch.zeros(n)
    buf = encode(grad, res, block, flags, seed)
    msg, dec = ref_encode(grad.float().numpy(), block, flags, seed)
    assert np.array_equal(buf.numpy(), msg)
    assert np.array_equal(bits(res), bits(torch.from_numpy(grad.float().numpy() - dec)))
    out = torch.zeros(n)
    _tagc.fp4_decode_add(out, buf, block, seed=seed, rotate=bool(flags & ROTATE))
    assert np.array_equal(bits(out), bits(torch.from_numpy(np.float32(0) + dec)))  # -0 + 0


def test_codes_and_scales_by_hand() -> None:
    """One block of 16: scale 1 (max 6), every level, ties to even, signs, zero."""
    x = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -0.3])
    buf = encode(x, None, 16, 0, 0)
    nib = [int(b) >> s & 15 for b in buf[:8] for s in (0, 4)]
    assert nib == [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 9]
    assert int(buf[8]) == 127  # 2^0
    y = x * 2.0 ** -20 * 1.25  # max 7.5 * 2^-20: 6 * 2^-19 is the smallest scale holding it
    assert int(encode(y, None, 16, 0, 0)[8]) == 127 - 19
    assert int(encode(torch.zeros(16), None, 16, 0, 0)[8]) == 0


def test_error_feedback_keeps_what_is_not_sent() -> None:
    """decoded + residual == v to fp32 rounding, and rotation helps heavy tails."""
    n = 1 << 14
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    errs = {}
    for flags in (0, ROTATE):
        res = torch.zeros(n)
        buf = encode(grad, res, 32, flags, 7)
        out = torch.zeros(n)
        _tagc.fp4_decode_add(out, buf, 32, seed=7, rotate=bool(flags))
        assert ((out + res - grad).abs() <= 1e-6 * (out.abs() + res.abs())).all()
        errs[flags] = float((res.norm() / grad.norm()) ** 2)
    assert errs[ROTATE] < errs[0] < 0.1


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((1 << 16,), 1.2)  # between 1 and 1.5 at scale 2^-? with 6.0 setting it
    x[::32] = 6.0
    out = torch.zeros_like(x)
    for seed in range(8):
        buf = encode(x, None, 32, STOCHASTIC, seed)
        _tagc.fp4_decode_add(out, buf, 32)
    mean = float(out[1::32].mean()) / 8
    assert abs(mean - 1.2) < 0.01
    assert set(np.unique(out[1::32].numpy() / 8).round(3)) != {1.0}


@pytest.mark.parametrize("n", [0, 1, 31, 256, 1000, 4097])
@pytest.mark.parametrize("block", [2, 16, 32, 64, 256])
def test_rht_matches_reference_and_inverts(n: int, block: int) -> None:
    x = gradient(n, torch.float32, seed=n)
    y = torch.full((n,), 7.0)
    _tagc.rht(y, x, block, 42)
    assert np.array_equal(bits(y), bits(torch.from_numpy(rotate(x.numpy(), block, 42, False))))
    z = torch.empty(n)
    _tagc.rht(z, y, block, 42, inverse=True)
    assert np.array_equal(bits(z), bits(torch.from_numpy(rotate(y.numpy(), block, 42, True))))
    if n:  # identity to float rounding (the butterflies round, relative to the block)
        assert float((z - x).abs().max()) <= 1e-5 * float(x.abs().max())
    whole = n // block * block  # orthonormal: block norms kept
    if whole:
        a, b = x[:whole].view(-1, block).norm(dim=1), y[:whole].view(-1, block).norm(dim=1)
        assert torch.allclose(a, b, rtol=1e-5)
    y2 = torch.empty(n)
    _tagc.rht(y2, x, block, 43)
    assert n < 2 or not torch.equal(y, y2)


def test_bad_input_raises_and_writes_nothing() -> None:
    grad = gradient(100, torch.float32, seed=1)
    res = torch.ones(100)
    buf = torch.zeros(_tagc.fp4_bytes(100, 32), dtype=torch.uint8)
    g = grad.clone()
    g[50] = float("nan")
    with pytest.raises(_tagc.NonFiniteError):
        _tagc.fp4_encode(buf, res, g, 32)
    assert torch.equal(res, torch.ones(100))
    with pytest.raises(_tagc.NonFiniteError):  # no residual: the single-pass route
        _tagc.fp4_encode(buf, None, g, 32, rotate=True)
    g = grad.clone()
    g[3] = 2.0 ** 100
    for rotate in (False, True):
        with pytest.raises(_tagc.NonFiniteError):
            _tagc.fp4_encode(buf, None, g, 32, rotate=rotate)
        with pytest.raises(_tagc.NonFiniteError):
            _tagc.fp4_encode(buf, res, g, 32, rotate=rotate)
    assert torch.equal(res, torch.ones(100))
    g[3] = float.fromhex("0x1.fffffep99")
    _tagc.fp4_encode(buf, None, g, 32, rotate=True)
    for bad in (3, 1, 512):
        with pytest.raises(ValueError):
            _tagc.fp4_encode(buf, None, grad, bad)
        with pytest.raises(ValueError):
            _tagc.fp4_decode_add(torch.zeros(100), buf, bad)
        with pytest.raises(ValueError):
            _tagc.rht(torch.zeros(100), grad, bad, 0)
    with pytest.raises(ValueError):
        _tagc.fp4_encode(buf[:-1], None, grad, 32)
    with pytest.raises(ValueError):
        _tagc.fp4_encode(buf, torch.zeros(99), grad, 32)
    with pytest.raises(ValueError):
        _tagc.fp4_decode_add(torch.zeros(100), buf[:-1], 32)
    with pytest.raises(ValueError):
        _tagc.fp4_decode_add(torch.zeros(101), buf, 32)
    with pytest.raises(ValueError):
        _tagc.rht(torch.zeros(99), grad, 32, 0)
    with pytest.raises(ValueError):
        _tagc.fp4_encode(buf, None, grad, 32, seed=-1)
    with pytest.raises(TypeError):
        _tagc.fp4_encode(buf, None, grad.double(), 32)
    with pytest.raises(TypeError):
        _tagc.fp4_decode_add(torch.zeros(100, dtype=torch.bfloat16), buf, 32)
    with pytest.raises(TypeError):
        _tagc.rht(torch.zeros(100), grad.bfloat16(), 32, 0)
    with pytest.raises(TypeError):
        _tagc.fp4_encode(buf, None, grad, 32.0)


def test_decode_takes_any_bytes() -> None:
    """Every nibble is a code (8 is -0); scale byte 255 decodes to NaN."""
    buf = torch.arange(_tagc.fp4_bytes(64, 32), dtype=torch.uint8)
    buf[-2:] = torch.tensor([127, 255], dtype=torch.uint8)
    out = torch.zeros(64)
    _tagc.fp4_decode_add(out, buf, 32)
    nib = np.stack([buf[:32].numpy() & 15, buf[:32].numpy() >> 4], 1).reshape(-1)
    assert np.array_equal(out[:32].numpy(), values_of(nib[:32]))
    assert torch.isnan(out[32:]).all()


# ----------------------------------------------------------------------------- CUDA twin
@pytest.fixture(scope="module")
def lib(cuda_emu_library: Path) -> C.CDLL:
    """The launchers compiled by g++ against the emulation (conftest's build), typed from
    ``tagc_bench.cuda_emu.SIGS``."""
    from tagc_bench import cuda_emu

    return cuda_emu.load(cuda_emu_library)


def P(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


DT = {torch.float32: 0, torch.bfloat16: 1}


def emu_encode(lib: C.CDLL, grad: torch.Tensor, res: Optional[torch.Tensor], block: int,
               flags: int, seed: int, at: int = 1) -> torch.Tensor:
    nb = _tagc.fp4_bytes(grad.numel(), block)
    buf = torch.full((nb + at + 1,), 0xEE, dtype=torch.uint8)
    w = torch.empty(max(lib.tagc_cuda_fp4_encode_workspace_size(), 1), dtype=torch.uint8)
    assert lib.tagc_cuda_fp4_encode(P(buf[at:]), nb, P(res), DT[res.dtype] if res is not None
                                    else 0, P(grad), DT[grad.dtype], grad.numel(), block, flags,
                                    seed, P(w), w.numel(), None) == 0
    assert (buf[:at] == 0xEE).all() and buf[-1] == 0xEE
    return buf[at:-1].clone()


@pytest.mark.slow
@pytest.mark.parametrize("n,block", [(1, 32), (7, 2), (1000, 32), (777, 16), (600, 256),
                                     (2100, 64)])
@pytest.mark.parametrize("gd,rd", [(torch.float32, None), (torch.float32, torch.float32),
                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("flags", [0, ROTATE, ROTATE | STOCHASTIC])
def test_cuda_emulated_matches_c(lib: C.CDLL, n: int, block: int, gd: torch.dtype,
                                 rd: Optional[torch.dtype], flags: int) -> None:
    seed = 1 << 63 | n
    grad = gradient(n, gd, seed=n)
    res = None if rd is None else (gradient(n, torch.float32, seed=n + 1) * 0.3).to(rd)
    c_res = None if res is None else res.clone()
    c_buf = encode(grad, c_res, block, flags, seed)
    e_buf = emu_encode(lib, grad, res, block, flags, seed)
    assert torch.equal(e_buf, c_buf)
    if res is not None:
        assert c_res is not None and np.array_equal(bits(res), bits(c_res))
    base = gradient(n, torch.float32, seed=n + 2)
    c_out, e_out = base.clone(), base.clone()
    _tagc.fp4_decode_add(c_out, c_buf, block, seed=seed, rotate=bool(flags & ROTATE))
    assert lib.tagc_cuda_fp4_decode_add(P(e_out), n, P(e_buf), e_buf.numel(), block,
                                        flags & ROTATE, seed, None) == 0
    assert np.array_equal(bits(e_out), bits(c_out))
    for inverse in (0, 1):
        c_y, e_y = torch.empty(n), torch.empty(n)
        _tagc.rht(c_y, base, block, seed, inverse=bool(inverse))
        assert lib.tagc_cuda_rht(P(e_y), n, P(base), n, block, seed, inverse, None) == 0
        assert np.array_equal(bits(e_y), bits(c_y))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [0, ROTATE])
def test_cuda_emulated_nonfinite_poisons(lib: C.CDLL, flags: int) -> None:
    grad = gradient(600, torch.float32, seed=3)
    grad[5] = float("nan")
    res = gradient(600, torch.float32, seed=4)
    r0 = res.clone()
    buf = emu_encode(lib, grad, res, 32, flags, 1)
    assert torch.equal(res, r0)
    assert (buf[-19:] == 255).all() and not buf[:300].any()
    out = torch.zeros(600)
    assert lib.tagc_cuda_fp4_decode_add(P(out), 600, P(buf), buf.numel(), 32, flags, 1,
                                        None) == 0
    assert torch.isnan(out).all()


@pytest.mark.slow
def test_cuda_emulated_argument_errors_match_c(lib: C.CDLL) -> None:
    g = torch.zeros(10)
    buf = torch.zeros(20, dtype=torch.uint8)
    w = torch.empty(16, dtype=torch.uint8)
    enc = lib.tagc_cuda_fp4_encode
    assert enc(P(buf), 5, None, 0, P(g), 0, 10, 32, 0, 0, P(w), 16, None) == 3  # CAPACITY
    assert enc(P(buf), 20, None, 0, P(g), 0, 10, 24, 0, 0, P(w), 16, None) == 2  # block
    assert enc(P(buf), 20, None, 0, P(g), 0, 10, 32, 4, 0, P(w), 16, None) == 2  # flag
    assert enc(P(buf), 20, None, 0, P(g), 5, 10, 32, 0, 0, P(w), 16, None) == 7  # dtype
    assert enc(None, 20, None, 0, P(g), 0, 10, 32, 0, 0, P(w), 16, None) == 1  # ARG
    assert lib.tagc_cuda_fp4_decode_add(P(g), 10, P(buf), 7, 32, 0, 0, None) == 2  # size
    assert lib.tagc_cuda_rht(P(g), 9, P(g), 10, 32, 0, 0, None) == 3
