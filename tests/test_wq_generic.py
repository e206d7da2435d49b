"""The wq encoders' two builds write the same bytes: ``_tagc`` (its AVX2 loops on a CPU
that has them, csrc/wq_blocks.h) against csrc/wq.c and csrc/wq_delta.c built here with
``-DTAGC_QUANT_NO_AVX2`` (the generic loops a CPU without AVX2 runs), called through
ctypes, on the reference tests' segment shapes, both formats and dtypes, values with
NaN and Inf among them, and a remembered copy at every alignment.  The reference tests
(test_wq.py, test_wq_delta.py) check ``_tagc`` itself against pure torch.
"""
from __future__ import annotations

import ctypes as C
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from test_wq import DTYPES, FORMATS, SEGS, weights

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

ROOT = Path(__file__).resolve().parents[1]
I64, VP, INT = C.c_int64, C.c_void_p, C.c_int
FORMAT = {"int8": 8, "int4": 4}  # tagc.h's tagc_qformat
DTYPE = {torch.float32: 0, torch.bfloat16: 1}  # tagc.h's tagc_dtype


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> C.CDLL:
    """csrc/wq.c and wq_delta.c (with the sizes and status they call) built with
    setup.py's C flags and the generic loops only."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        pytest.skip("no C compiler to build csrc/wq.c")
    so = tmp_path_factory.mktemp("wq_generic") / "libwq.so"
    subprocess.run([cc, "-std=c11", "-O3", "-fno-trapping-math", "-fPIC", "-shared",
                    "-DTAGC_QUANT_NO_AVX2", "-I", str(ROOT / "csrc"),
                    *(str(ROOT / "csrc" / f) for f in ("wq.c", "wq_delta.c", "sizes.c",
                                                       "status.c")),
                    "-o", str(so), "-lm"], check=True)
    dll = C.CDLL(str(so))
    dll.tagc_wq_encode.restype = INT
    dll.tagc_wq_encode.argtypes = [VP, I64, VP, INT, I64, VP, I64, INT, I64]
    dll.tagc_wq_delta_encode.restype = INT
    dll.tagc_wq_delta_encode.argtypes = [VP, I64, VP, VP, VP, INT, I64, VP, I64, INT, I64]
    return dll


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def values(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """test_wq's weights (Gaussian, ties of round-half-even, or spread over many
    binades, by seed) with a NaN and an Inf in them past the first few (a sentinel
    block) and a run of zeros (a zero block)."""
    w = weights(n, seed, torch.float32, ("randn", "ties", "spread")[seed % 3])
    if n > 300:
        w[290] = float("nan")
        w[-1] = float("inf")
        w[:64] = 0.0
    return w.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("block", [1, 5, 64, 256])
def test_generic_loops_write_the_avx2_bytes(generic: C.CDLL, fmt: str, dt: torch.dtype,
                                            block: int) -> None:
    for si, segs in enumerate(SEGS):
        n = sum(segs)
        seg = torch.tensor(segs, dtype=torch.int64)
        src = values(n, 70 + si, dt)
        nb = _tagc.wq_bytes(seg, fmt, block)
        want = torch.empty(max(nb, 1), dtype=torch.uint8)
        got = torch.full((max(nb, 1),), 0xAB, dtype=torch.uint8)
        _tagc.wq_encode(want[:nb], src, seg, fmt, block)
        assert generic.tagc_wq_encode(ptr(got), nb, ptr(src), DTYPE[dt], n, ptr(seg),
                                      len(segs), FORMAT[fmt], block) == 0
        assert torch.equal(got[:nb], want[:nb]), (si, "wq")

        base = (src.float() + 1e-2 * weights(n, 90 + si)).to(dt)
        nd = _tagc.wq_delta_bytes(seg, fmt, block)
        room = [torch.full((n + 16,), -3.0, dtype=dt) for _ in range(2)]
        sent = [r[3:3 + n] for r in room]  # not 32-byte aligned
        want, got = torch.empty(nd, dtype=torch.uint8), torch.full((nd,), 0xAB, dtype=torch.uint8)
        _tagc.wq_delta_encode(want, src, sent[0], base, seg, fmt, block)
        assert generic.tagc_wq_delta_encode(ptr(got), nd, ptr(src), ptr(sent[1]), ptr(base),
                                            DTYPE[dt], n, ptr(seg), len(segs), FORMAT[fmt],
                                            block) == 0
        assert torch.equal(got, want), (si, "wq_delta")
        assert torch.equal(room[0].view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                           room[1].view(torch.int16 if dt == torch.bfloat16 else torch.int32))
