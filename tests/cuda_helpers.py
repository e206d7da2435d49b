"""Scaffolding shared by the CUDA test files (test_cuda_ops, test_cuda_hook,
test_cuda_emulated): the device under test, the skip mark, and the inputs the
op-level tests build (gradients, kept sets, packed bitmaps, a two-rank summed
sketch) and their bitwise comparison, which live in ``tagc_bench.cuda_ops``
(``scripts/gpu_check.sh`` builds its op table from them too)."""
from __future__ import annotations

import os
from types import ModuleType
from typing import List, Optional, Tuple

import pytest
import torch

from tagc_bench.cuda_ops import (bitmap_of, gradient, kept, same_bits,  # noqa: F401 (re-exported)
                                 two_rank_sketch)

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
