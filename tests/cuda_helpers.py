"""Scaffolding shared by the CUDA test files (test_cuda_ops, test_cuda_hook,
test_cuda_emulated): the device under test, the skip mark, and the inputs the
op-level tests build (kept sets, packed bitmaps, a two-rank summed sketch)."""
from __future__ import annotations

import math
import os
from types import ModuleType
from typing import List, Optional, Tuple

import pytest
import torch

# "cpu" runs the CUDA harnesses with both sides on the CPU: a self-check of
# the test code only, never of CUDA.
DEV = os.environ.get("TAGC_CUDA_TEST_DEVICE", "cuda")

# (grad, residual or None, val) dtypes the sparsify tests cover: every dtype
# in each role, residual absent, and mixed precisions.
SPARSIFY_DTYPES: List[Tuple[torch.dtype, Optional[torch.dtype], torch.dtype]] = [
    (torch.float32, torch.float32, torch.float32),
    (torch.float32, None, torch.float32),
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
]


def cuda_ready(ext: ModuleType) -> bool:
    """Whether a GPU is present and the ``_tagc`` module ``ext`` was built with CUDA.

    Args:
        ext: the imported ``_tagc`` module.

    Returns:
        True when CUDA ops can run.
    """
    return (torch.cuda.is_available() and hasattr(ext, "cuda_available")
            and bool(ext.cuda_available()))


def needs_cuda(ext: ModuleType) -> pytest.MarkDecorator:
    """The module-level skip mark of the CUDA test files.

    Args:
        ext: the imported ``_tagc`` module.

    Returns:
        A skipif mark: skip on DEV == "cuda" without a usable CUDA build.
    """
    return pytest.mark.skipif(
        DEV == "cuda" and not cuda_ready(ext),
        reason="needs a CUDA GPU and _tagc built with CUDA (TAGC_BUILD_CUDA=1)")


def kept(n: int, k: int, vd: torch.dtype, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random kept set: k distinct ascending int32 positions below n and values.

    Args:
        n: shard length.
        k: number of kept entries.
        vd: value dtype.
        seed: generator seed.

    Returns:
        (idx, val).
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    return idx, torch.randn(k, generator=g).to(vd)


def bitmap_of(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask into the codec's bitmap (bit p of byte p // 8, LSB first).

    Args:
        mask: 1-D bool tensor of n entries.

    Returns:
        uint8 tensor of ceil(n / 8) bytes, tail bits 0.
    """
    n = mask.numel()
    pad = torch.zeros((n + 7) // 8 * 8, dtype=torch.bool)
    pad[:n] = mask
    return (pad.view(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)


def two_rank_sketch(ext: ModuleType, n: int, u: int, c: float,
                    sd: torch.dtype) -> Tuple[int, int, torch.Tensor, torch.Tensor]:
    """Two ranks' kept sets encoded by the C op and summed, as the owner gets
    them in `exact` mode.

    Args:
        ext: the imported ``_tagc`` module.
        n: shard length.
        u: size of the union (each rank keeps u // 2).
        c: buckets per union entry (t = ceil(c * u / 3)).
        sd: dtype of the summed sketch.

    Returns:
        (t, seed, sketch of 3 * t entries in sd, bool union mask of n).
    """
    t = max(1, math.ceil(c * u / 3))
    seed = ext.seed_derive(0, 1, 2)
    sk = torch.zeros(3 * t)
    union = torch.zeros(n, dtype=torch.bool)
    for r in range(2):
        idx, val = kept(n, u // 2, torch.float32, seed=100 + r)
        part = torch.empty(3 * t)
        ext.sketch_encode(part, idx, val, n, t, seed)
        sk += part
        union[idx.long()] = True
    return t, seed, sk.to(sd), union
