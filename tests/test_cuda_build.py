"""The CUDA build switch on any machine (no GPU needed).

Whatever setup.py built (CPU-only, or with the CUDA kernels through the
static CUDA runtime), ``import _tagc`` must not need a CUDA driver or a
shared CUDA runtime, and ``cuda_available()`` must be False wherever torch
sees no GPU: the hook relies on it to choose its path.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

_tagc = pytest.importorskip("_tagc")


def test_cuda_available_is_a_bool_and_false_without_a_gpu() -> None:
    got = _tagc.cuda_available()
    assert isinstance(got, bool)
    if not torch.cuda.is_available():
        assert got is False


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_extension_needs_no_cuda_shared_library() -> None:
    dyn = subprocess.run(["readelf", "-d", _tagc.__file__], capture_output=True, text=True,
                         check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dyn.splitlines()
              if "(NEEDED)" in line]
    assert needed, dyn  # at least libc: the parse worked
    bad = [lib for lib in needed if lib.startswith(("libcuda.", "libcudart."))]
    assert not bad, f"_tagc links {bad}: importing it would fail without a driver"
