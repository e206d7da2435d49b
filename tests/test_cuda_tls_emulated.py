"""The CUDA twin of the tls code (``cuda/tls.cu``) run on the CPU through the emulation
(``cuda/emu/``) against the C op (``csrc/tls.c``): the same bytes, residual and decoded
values bit for bit, the NaN message a non-finite input turns into, corrupt messages
reported through the device status word, and the C op's argument errors.

The C op is called through ctypes on a library built here from ``csrc/tls.c`` with
setup.py's C flags (``-std=c11`` keeps gcc from fusing a product into an add, as the
extension is built), so the comparison is with the checkout's source whatever ``_tagc``
was last built from.  It says nothing about a GPU: only the emulated kernels' logic.
"""
from __future__ import annotations

import ctypes as C
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pytest
import torch

pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = [pytest.mark.codec, pytest.mark.slow]
from tagc_bench import cuda_emu
from tagc_bench.cuda_emu import DT, F32, P, ws

ROOT = Path(__file__).resolve().parents[1]
OK, ERR_ARG, ERR_RANGE, ERR_CAPACITY, ERR_NONFINITE, ERR_CORRUPT, ERR_DTYPE = 0, 1, 2, 3, 5, 6, 7
FLT_MAX = float(np.finfo(np.float32).max)
NAN_BITS = 0x7FC00000
I64, VP, INT = C.c_int64, C.c_void_p, C.c_int
C_SIGS = {
    "tagc_tls_bytes": (I64, [I64]),
    "tagc_tls_encode": (INT, [VP, I64, VP, INT, VP, INT, I64]),
    "tagc_tls_decode_add": (INT, [VP, I64, VP, I64]),
}


@pytest.fixture(scope="module")
def lib(cuda_emu_library: Path) -> C.CDLL:
    """The launchers compiled by g++ against the emulation (conftest's build)."""
    return cuda_emu.load(cuda_emu_library)


def build_c_op(folder: Path, *defines: str) -> C.CDLL:
    """The C op, csrc/tls.c alone (its helpers are header-only), in a shared library
    built with setup.py's flags and ``defines``."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        pytest.skip("no C compiler to build csrc/tls.c")
    so = folder / "libtls.so"
    subprocess.run([cc, "-std=c11", "-O3", "-fno-trapping-math", "-fPIC", "-shared", *defines,
                    "-I", str(ROOT / "csrc"), str(ROOT / "csrc" / "tls.c"), "-o", str(so), "-lm"],
                   check=True)
    dll = C.CDLL(str(so))
    for name, (ret, args) in C_SIGS.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = ret, args
    return dll


@pytest.fixture(scope="module")
def cop(tmp_path_factory: pytest.TempPathFactory) -> C.CDLL:
    """The C op as the extension builds it (its AVX2 encoder where the CPU has one)."""
    return build_c_op(tmp_path_factory.mktemp("tls_c"))


@pytest.fixture(scope="module")
def cop_generic(tmp_path_factory: pytest.TempPathFactory) -> C.CDLL:
    """The C op with its generic loops only (what a CPU without AVX2 runs)."""
    return build_c_op(tmp_path_factory.mktemp("tls_generic"), "-DTAGC_QUANT_NO_AVX2")


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy()


def rows(n: int, seed: int, lo: float = -8.0, hi: float = 3.0) -> torch.Tensor:
    """Gaussian values whose rows of 32 are scaled by 10**uniform(lo, hi), with exact
    zeros inside (single values and a whole block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    scale = 10.0 ** (lo + (hi - lo) * torch.rand((n + 31) // 32, generator=g,
                                                 dtype=torch.float64))
    x = x * scale.repeat_interleave(32)[:n]
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    if n > 96:
        x[64:96] = 0.0
    return x.float()


def wide(n: int, seed: int) -> torch.Tensor:
    """Groups of 512 values scaled by 10**uniform(-30, 3), their rows of 32 by a further
    10**uniform(-1.6, 0) (a little over the block code's 14/3 octaves), one row of each
    group and the whole second group subnormal: group codes 0 to 254 and 255, block codes
    0 to 14 and 15."""
    g = torch.Generator().manual_seed(seed)
    nb = (n + 31) // 32
    ge = -30.0 + 33.0 * torch.rand((nb + 15) // 16, generator=g, dtype=torch.float64)
    ro = -1.6 * torch.rand(nb, generator=g, dtype=torch.float64)
    e = ge.repeat_interleave(16)[:nb] + ro
    e[3::16] = -40.0
    e[16:32] = -41.0
    x = torch.randn(n, generator=g, dtype=torch.float64) * (10.0 ** e).repeat_interleave(32)[:n]
    return x.float()


def inputs(n: int, gd: torch.dtype, rd: Optional[torch.dtype], seed: int, kind: str = "rows"
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if kind == "rows":
        g, r = rows(n, seed), rows(n, seed + 1) / 4
    elif kind == "zeros":
        g, r = torch.zeros(n), torch.zeros(n)
    elif kind == "wide":
        g, r = wide(n, seed), wide(n, seed + 1) / 4
    elif kind == "tiny":  # S near 1e-34: most raw scales below FLT_MIN (0), the rest near it
        g, r = wide(n, seed) * 1e-37, wide(n, seed + 1) * 2e-38
    elif kind == "huge":  # near FLT_MAX, with a residual too small to carry it to Inf
        h = torch.Generator().manual_seed(seed)
        g = torch.where(torch.rand(n, generator=h) < 0.5, -1.0, 1.0) * FLT_MAX
        g = g * (0.5 + 0.5 * torch.rand(n, generator=h))
        g[::7] = FLT_MAX
        g[3::7] = -FLT_MAX
        if gd == torch.bfloat16:  # bf16's largest finite is below FLT_MAX
            g = g.clamp(-3.38e38, 3.38e38)
        r = rows(n, seed + 1)
    else:
        raise ValueError(kind)
    return g.to(gd), (None if rd is None else r.to(rd))


def c_encode(cop: C.CDLL, grad: torch.Tensor, res: Optional[torch.Tensor]
             ) -> Tuple[int, torch.Tensor]:
    nb = cop.tagc_tls_bytes(grad.numel())
    buf = torch.full((max(nb, 1),), 0xEE, dtype=torch.uint8)
    st = cop.tagc_tls_encode(P(buf), nb, P(res), DT[res.dtype] if res is not None else F32,
                             P(grad), DT[grad.dtype], grad.numel())
    return st, buf[:nb]


def e_encode(lib: C.CDLL, cop: C.CDLL, grad: torch.Tensor, res: Optional[torch.Tensor],
             at: int = 1) -> torch.Tensor:
    """The emulated encoder's message, written at an odd offset of a guarded buffer."""
    n = grad.numel()
    nb = cop.tagc_tls_bytes(n)
    buf = torch.full((nb + at + 1,), 0xEE, dtype=torch.uint8)
    w = ws(lib.tagc_cuda_tls_encode_workspace_size(n))
    assert lib.tagc_cuda_tls_encode(P(buf[at:]), nb, P(res),
                                    DT[res.dtype] if res is not None else F32, P(grad),
                                    DT[grad.dtype], n, P(w), w.numel(), None) == OK
    assert (buf[:at] == 0xEE).all() and buf[-1] == 0xEE
    return buf[at:-1].clone()


def e_decode(lib: C.CDLL, out: torch.Tensor, msg: torch.Tensor,
             status: Optional[torch.Tensor] = None) -> int:
    w = ws(lib.tagc_cuda_tls_decode_add_workspace_size())
    return lib.tagc_cuda_tls_decode_add(P(out), out.numel(), P(msg), msg.numel(), P(status),
                                        P(w), w.numel(), None)


def base(n: int, seed: int) -> torch.Tensor:
    """A random non-zero sum to decode into."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) + torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


def check_twin(lib: C.CDLL, cop: C.CDLL, grad: torch.Tensor, res: Optional[torch.Tensor],
               seed: int) -> None:
    """Bytes, residual and decoded values of the twin equal the C op's, bit for bit."""
    n = grad.numel()
    c_res = None if res is None else res.clone()
    st, c_buf = c_encode(cop, grad, c_res)
    assert st == OK
    e_res = None if res is None else res.clone()
    e_buf = e_encode(lib, cop, grad, e_res)
    assert torch.equal(e_buf, c_buf)
    if res is not None:
        assert np.array_equal(bits(e_res), bits(c_res))
    c_out, e_out = base(n, seed), base(n, seed)
    assert cop.tagc_tls_decode_add(P(c_out), n, P(c_buf), c_buf.numel()) == OK
    status = torch.zeros(1, dtype=torch.int32)
    assert e_decode(lib, e_out, e_buf, status) == OK
    assert int(status) == 0
    assert np.array_equal(bits(e_out), bits(c_out))


SIZES = [0, 1, 31, 32, 33, 511, 512, 513, 1000, 4096 + 7]
DTYPES = [(torch.float32, None), (torch.float32, torch.float32),
          (torch.float32, torch.bfloat16), (torch.bfloat16, None),
          (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gd,rd", DTYPES)
def test_twin_matches_c(lib: C.CDLL, cop: C.CDLL, n: int, gd: torch.dtype,
                        rd: Optional[torch.dtype]) -> None:
    grad, res = inputs(n, gd, rd, seed=n)
    check_twin(lib, cop, grad, res, seed=n + 5)


@pytest.mark.parametrize("kind", ["rows", "zeros", "wide", "tiny", "huge"])
@pytest.mark.parametrize("gd,rd", DTYPES)
def test_generic_loops_match_the_avx2_ones(cop: C.CDLL, cop_generic: C.CDLL, kind: str,
                                           gd: torch.dtype, rd: Optional[torch.dtype]) -> None:
    """The encoder's two builds write the same bytes and residual (the C op is one
    contract whichever loops a CPU runs)."""
    for n in (1, 33, 159, 160, 161, 1000, 100003):
        grad, res = inputs(n, gd, rd, seed=7 * n + 3, kind=kind)
        r1 = None if res is None else res.clone()
        r2 = None if res is None else res.clone()
        st1, b1 = c_encode(cop, grad, r1)
        st2, b2 = c_encode(cop_generic, grad, r2)
        assert st1 == st2 == OK and torch.equal(b1, b2), (kind, n)
        if res is not None:
            assert np.array_equal(bits(r1), bits(r2)), (kind, n)


@pytest.mark.parametrize("kind", ["zeros", "wide", "tiny", "huge"])
@pytest.mark.parametrize("n", [33, 1000, 4096 + 7])
@pytest.mark.parametrize("gd,rd", [(torch.float32, torch.float32),
                                   (torch.bfloat16, torch.bfloat16)])
def test_twin_matches_c_at_the_edges(lib: C.CDLL, cop: C.CDLL, kind: str, n: int,
                                     gd: torch.dtype, rd: Optional[torch.dtype]) -> None:
    grad, res = inputs(n, gd, rd, seed=3 * n + 1, kind=kind)
    check_twin(lib, cop, grad, res, seed=n)


def test_twin_matches_c_large(lib: C.CDLL, cop: C.CDLL) -> None:
    grad, res = inputs(100_003, torch.float32, torch.bfloat16, seed=11)
    check_twin(lib, cop, grad, res, seed=12)


def test_scale_codes_span_their_range(lib: C.CDLL, cop: C.CDLL) -> None:
    """The wide input reaches group codes 0, inner ones, 254 and 255 and every block
    code, so the comparisons are not all of ordinary codes."""
    n = 100_003
    grad, res = inputs(n, torch.float32, torch.float32, seed=5, kind="wide")
    check_twin(lib, cop, grad, res, seed=6)
    _, buf = c_encode(cop, grad, None)
    ng, nb = (n + 511) // 512, (n + 31) // 32
    gcodes = set(buf[4:4 + ng].tolist())
    nib = buf[4 + ng:4 + ng + (nb + 1) // 2]
    bcodes = set((nib & 15).tolist()) | set((nib >> 4).tolist())
    assert {0, 254, 255} <= gcodes and len(gcodes & set(range(1, 254))) > 10
    assert bcodes == set(range(16))


def ulps(x: float, d: int) -> float:
    """The float32 d steps from float32(x)."""
    u = np.array([x], dtype=np.float32).view(np.int32) + d
    return float(u.view(np.float32)[0])


def at_thresholds() -> torch.Tensor:
    """Blocks of one magnitude r (raw scale r exactly, signs alternating) whose ratios
    R / S and r / M sit within a few ulps of the code thresholds of tls.h, where a
    division rounded otherwise than the C op's changes a code.  S = 3 (1/3 inexact), and
    every group of block candidates holds a block of 3 (code 0, M = 3)."""
    gthr = [2.0 ** ((k + 0.5) / 16) for k in range(16)]
    bthr = [2.0 ** ((k + 0.5) / 3) for k in range(3)]
    group_r = [ulps(3.0 * t * 2.0 ** -e, d) for t in gthr for e in (1, 6) for d in range(-2, 3)]
    block_r = [ulps(3.0 * t * 2.0 ** -e, d) for t in bthr for e in (1, 2, 4)
               for d in range(-2, 3)]
    blocks = []
    for r in group_r:
        blocks += [r] + [0.0] * 15
    for i in range(0, len(block_r), 15):
        chunk = block_r[i:i + 15]
        blocks += [3.0] + chunk + [0.0] * (15 - len(chunk))
    sign = torch.tensor([1.0, -1.0]).repeat(16)
    return (torch.tensor(blocks, dtype=torch.float64)[:, None] * sign).reshape(-1).float()


def test_twin_matches_c_at_the_code_thresholds(lib: C.CDLL, cop: C.CDLL) -> None:
    grad = at_thresholds()
    check_twin(lib, cop, grad, torch.zeros_like(grad), seed=8)


def test_group_scale_underflow_sends_nothing(lib: C.CDLL, cop: C.CDLL) -> None:
    """A group whose largest raw scale is just above FLT_MIN while its code's scale
    S 2^(-g/16) rounds below it: the group is sent as code 255 (nothing)."""
    s, r = 0.99 * 2.0 ** -120, 1.01 * 2.0 ** -126
    grad = torch.zeros(1024, dtype=torch.float64)
    grad[:32], grad[512:544] = s, -r
    grad = grad.float()
    check_twin(lib, cop, grad, torch.zeros(1024), seed=10)
    _, buf = c_encode(cop, grad, None)
    assert buf[4:6].tolist() == [0, 255] and buf[6] == 0xF0 and (buf[7:22] == 0xFF).all()


def test_block_sums_in_the_c_order(lib: C.CDLL, cop: C.CDLL) -> None:
    """A block whose raw scale tells the C op's lane tree from a sequential sum or the
    reversed tree: X + 2^-32 ties to X in double, X + 2 * 2^-32 does not, and 5 X / 64
    is a float32 midpoint, so one lost 2^-31 moves S by an ulp."""
    x, t = 3355445.0, 2.0 ** -32
    grad = torch.zeros(64, dtype=torch.float64)
    grad[0], grad[1], grad[17] = x, t, t
    grad[33:64:3] = 1000.0  # a second, smaller block
    grad = grad.float()
    tree = np.float32(2.5 * (x + 2 * t) / 32)  # lane 1 + lane 17, then lane 0 + lane 1
    assert tree != np.float32(2.5 * x / 32)  # what the sequential and reversed sums give
    _, buf = c_encode(cop, grad, None)
    assert buf[:4].numpy().view(np.float32)[0] == tree
    check_twin(lib, cop, grad, None, seed=9)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "overflow"])
@pytest.mark.parametrize("rd", [torch.float32, torch.bfloat16])
def test_nonfinite_gives_the_nan_message(lib: C.CDLL, cop: C.CDLL, bad, rd: torch.dtype
                                         ) -> None:
    n = 1000
    grad, res = inputs(n, torch.float32, rd, seed=7)
    if bad == "overflow":  # finite grad and residual whose sum is Inf
        grad[517], res[517] = FLT_MAX, 3.0e38
    else:
        grad[517] = bad
    r0 = res.clone()
    c_res = res.clone()
    st, _ = c_encode(cop, grad, c_res)
    assert st == ERR_NONFINITE and np.array_equal(bits(c_res), bits(r0))
    buf = e_encode(lib, cop, grad, res)
    assert np.array_equal(bits(res), bits(r0))
    assert int.from_bytes(bytes(buf[:4].tolist()), "little") == NAN_BITS
    for out, run in ((base(n, 1), lambda o: e_decode(lib, o, buf)),
                     (base(n, 2), lambda o: cop.tagc_tls_decode_add(P(o), n, P(buf),
                                                                    buf.numel()))):
        assert run(out) == OK
        assert torch.isnan(out).all()


@pytest.mark.parametrize("header", [NAN_BITS, 0xFFC00000, 0x7F800001])
def test_any_nan_header_adds_nan(lib: C.CDLL, cop: C.CDLL, header: int) -> None:
    n = 513
    grad, _ = inputs(n, torch.float32, None, seed=4)
    _, buf = c_encode(cop, grad, None)
    buf[:4] = torch.tensor(list(header.to_bytes(4, "little")), dtype=torch.uint8)
    c_out, e_out = base(n, 3), base(n, 3)
    assert cop.tagc_tls_decode_add(P(c_out), n, P(buf), buf.numel()) == OK
    assert e_decode(lib, e_out, buf) == OK
    assert torch.isnan(c_out).all() and torch.isnan(e_out).all()


@pytest.mark.parametrize("n", [1, 37, 5000])
def test_decode_of_any_valid_message_matches_c(lib: C.CDLL, cop: C.CDLL, n: int) -> None:
    """Random group and block codes (255, 15 and the pad nibble included) and digits."""
    g = torch.Generator().manual_seed(n)
    nbytes = cop.tagc_tls_bytes(n)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    trits_at = 4 + (n + 511) // 512 + ((n + 31) // 32 + 1) // 2
    buf[trits_at:] = torch.randint(0, 243, (nbytes - trits_at,), dtype=torch.uint8, generator=g)
    for s in (1.0, 3.0e38, 2.0e-38, 0.0):
        buf[:4] = torch.tensor(np.frombuffer(np.float32(s).tobytes(), np.uint8).copy())
        c_out, e_out = base(n, n), base(n, n)
        assert cop.tagc_tls_decode_add(P(c_out), n, P(buf), nbytes) == OK
        assert e_decode(lib, e_out, buf) == OK
        assert np.array_equal(bits(e_out), bits(c_out))


CORRUPT = [("trit", 0, 243), ("trit", -1, 255), ("trit", 57, 250),
           ("header", None, 0xBF800000), ("header", None, 0x80000000),
           ("header", None, 0x7F800000), ("header", None, 0xFF800000)]


@pytest.mark.parametrize("where,at,value", CORRUPT)
def test_corrupt_message_leaves_out_untouched(lib: C.CDLL, cop: C.CDLL, where: str,
                                              at: Optional[int], value: int) -> None:
    n = 1000
    grad, _ = inputs(n, torch.float32, None, seed=9)
    _, buf = c_encode(cop, grad, None)
    if where == "trit":
        trits_at = buf.numel() - (n + 4) // 5
        buf[trits_at + at if at >= 0 else at] = value
    else:
        buf[:4] = torch.tensor(list(value.to_bytes(4, "little")), dtype=torch.uint8)
    out0 = base(n, 1)
    c_out = out0.clone()
    assert cop.tagc_tls_decode_add(P(c_out), n, P(buf), buf.numel()) == ERR_CORRUPT
    assert np.array_equal(bits(c_out), bits(out0))
    for status in (torch.zeros(1, dtype=torch.int32), None):
        e_out = out0.clone()
        assert e_decode(lib, e_out, buf, status) == OK
        assert np.array_equal(bits(e_out), bits(out0))
        if status is not None:
            assert int(status) == ERR_CORRUPT


def test_argument_errors_match_c(lib: C.CDLL, cop: C.CDLL) -> None:
    n = 100
    nb = cop.tagc_tls_bytes(n)
    assert nb == 4 + 1 + 2 + 20
    assert [cop.tagc_tls_bytes(k) for k in (0, -1, 2**31)] == [0, -1, -1]
    g = torch.ones(n)
    w = ws(lib.tagc_cuda_tls_encode_workspace_size(n))
    encode_cases = [  # (dst?, capacity, residual?, residual dtype, grad?, grad dtype, n, want)
        (True, nb - 1, False, F32, True, F32, n, ERR_CAPACITY),
        (True, nb, False, F32, True, 5, n, ERR_DTYPE),
        (True, nb, True, 3, True, F32, n, ERR_DTYPE),
        (True, nb, False, 3, True, F32, n, OK),  # no residual: its dtype is not read
        (False, nb, False, F32, True, F32, n, ERR_ARG),
        (True, nb, False, F32, False, F32, n, ERR_ARG),
        (True, nb, False, F32, True, F32, -1, ERR_RANGE),
        (True, 2**40, False, F32, True, F32, 2**31, ERR_RANGE),
        (False, 0, False, F32, False, F32, 0, OK),
        (False, 0, False, F32, False, 5, 0, ERR_DTYPE),  # checked before the empty case
    ]
    for dst_p, cap, res_p, rd, grad_p, gd, k, want in encode_cases:
        got = []
        for run in ("c", "emu"):
            dst = torch.zeros(nb, dtype=torch.uint8)
            res = torch.zeros(n)
            args = (P(dst) if dst_p else None, cap, P(res) if res_p else None, rd,
                    P(g) if grad_p else None, gd, k)
            got.append(cop.tagc_tls_encode(*args) if run == "c"
                       else lib.tagc_cuda_tls_encode(*args, P(w), w.numel(), None))
        assert got == [want, want], (dst_p, cap, res_p, rd, grad_p, gd, k, got)
    msg = torch.zeros(nb, dtype=torch.uint8)
    wd = ws(lib.tagc_cuda_tls_decode_add_workspace_size())
    decode_cases = [  # (out?, n, src?, src_bytes, want)
        (True, n, True, nb - 1, ERR_RANGE), (True, n, True, nb + 1, ERR_RANGE),
        (False, n, True, nb, ERR_ARG), (True, n, False, nb, ERR_ARG),
        (True, -1, True, nb, ERR_RANGE), (True, 2**31, True, 2**40, ERR_RANGE),
        (False, 0, False, 0, OK), (True, 0, True, 1, ERR_RANGE), (True, n, True, nb, OK)]
    for out_p, k, src_p, sb, want in decode_cases:
        got = []
        for run in ("c", "emu"):
            out = torch.zeros(n)
            args = (P(out) if out_p else None, k, P(msg) if src_p else None, sb)
            got.append(cop.tagc_tls_decode_add(*args) if run == "c"
                       else lib.tagc_cuda_tls_decode_add(*args, None, P(wd), wd.numel(), None))
        assert got == [want, want], (out_p, k, src_p, sb, got)
    # the workspace, the launchers' own argument
    dst = torch.zeros(nb, dtype=torch.uint8)
    enc = lib.tagc_cuda_tls_encode
    assert enc(P(dst), nb, None, F32, P(g), F32, n, None, w.numel(), None) == ERR_ARG
    assert enc(P(dst), nb, None, F32, P(g), F32, n, P(w), w.numel() - 1, None) == ERR_CAPACITY
    dec = lib.tagc_cuda_tls_decode_add
    assert dec(P(g), n, P(msg), nb, None, None, wd.numel(), None) == ERR_ARG
    assert dec(P(g), n, P(msg), nb, None, P(wd), 0, None) == ERR_CAPACITY
    assert lib.tagc_cuda_tls_encode_workspace_size(2**20) >= (2**15) * 4
