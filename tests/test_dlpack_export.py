"""``_tagc.set_dlpack_exporter``: the fast export of plain torch tensors.

``tagc.codec`` registers ``torch._C._to_dlpack`` for ``torch.Tensor`` (the Python method
``__dlpack__`` costs about 8 times more per tensor, and a unit's call passes up to six).
The registered exporter must give the same checks and results as ``__dlpack__``, be used
for exactly its type, and be replaceable and removable.
"""
from __future__ import annotations

from typing import Iterator, List

import pytest
import torch

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

import tagc.codec  # noqa: E402,F401 - registers the exporter


@pytest.fixture
def counting() -> Iterator[List[int]]:
    """torch's exporter behind a counter; tagc's registration restored after."""
    calls: List[int] = []

    def export(t: torch.Tensor):
        calls.append(1)
        return torch._C._to_dlpack(t)

    _tagc.set_dlpack_exporter(torch.Tensor, export)
    try:
        yield calls
    finally:
        _tagc.set_dlpack_exporter(torch.Tensor, torch._C._to_dlpack)


def test_used_for_exactly_its_type(counting: List[int]) -> None:
    bm = torch.tensor([0xFF, 0x01], dtype=torch.uint8)
    assert _tagc.popcount(bm, 16) == 9 and len(counting) == 1
    p = torch.nn.Parameter(bm.clone(), requires_grad=False)  # a subclass: __dlpack__
    assert _tagc.popcount(p, 16) == 9 and len(counting) == 1


def test_same_results_and_checks_with_and_without(counting: List[int]) -> None:
    g = torch.randn(300)
    bufs = []
    for fast in (True, False):
        if not fast:
            _tagc.set_dlpack_exporter(None, None)
        buf = torch.empty(_tagc.quant_bytes(300, "int4", 64), dtype=torch.uint8)
        res = torch.zeros(300)
        _tagc.quant_encode(buf, res, g, "int4", 64)
        bufs.append((buf, res))
        with pytest.raises(TypeError, match="requires grad"):
            _tagc.quant_encode(buf, None, g.clone().requires_grad_(), "int4", 64)
        with pytest.raises(TypeError, match="contiguous"):
            _tagc.quant_encode(buf, None, torch.randn(600)[::2], "int4", 64)
        with pytest.raises(TypeError, match="grad"):
            _tagc.quant_encode(buf, None, g.double(), "int4", 64)
    assert torch.equal(bufs[0][0], bufs[1][0]) and torch.equal(bufs[0][1], bufs[1][1])
    assert len(counting) > 0


def test_a_bad_exporter_is_refused_or_reported() -> None:
    try:
        with pytest.raises(TypeError, match="a type and a callable"):
            _tagc.set_dlpack_exporter(torch.Tensor, None)
        with pytest.raises(TypeError, match="a type and a callable"):
            _tagc.set_dlpack_exporter(1, torch._C._to_dlpack)
        _tagc.set_dlpack_exporter(torch.Tensor, lambda t: 1)
        with pytest.raises(TypeError, match="'bitmap'.*'dltensor' capsule"):
            _tagc.popcount(torch.zeros(2, dtype=torch.uint8), 16)

        def fails(t: torch.Tensor):
            raise RuntimeError("no")

        _tagc.set_dlpack_exporter(torch.Tensor, fails)
        with pytest.raises(TypeError, match="'bitmap' cannot be exported"):
            _tagc.popcount(torch.zeros(2, dtype=torch.uint8), 16)
    finally:
        _tagc.set_dlpack_exporter(torch.Tensor, torch._C._to_dlpack)
