"""FSDP2's reduce-scatter layout of one unit, for the one-process simulations of several
ranks (``scripts/research/sim_feedback.py``, ``tagc_bench.gpu_quality``).

FSDP2 shards each parameter on dim 0 (padded to a multiple of N) and hands the hook one
flat buffer per unit: row r (shard r) is chunk r of every parameter, flattened and
concatenated in the unit's parameter order.  The all-gather's message of rank r is the
same row, one segment per parameter (``_tagc.wq_encode``'s ``segs``).
"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.nn as nn


class UnitRows:
    """One unit as FSDP2 lays it out for N ranks.

    Args:
        name: the unit's name.
        params: its parameters, in the unit's order.
        n: ranks.
    """

    def __init__(self, name: str, params: List[nn.Parameter], n: int) -> None:
        self.name, self.params, self.n = name, params, n
        self.chunks = [math.ceil(p.shape[0] / n) for p in params]
        self.row = sum(c * (p.numel() // p.shape[0]) for c, p in zip(self.chunks, params))

    @property
    def segments(self) -> List[int]:
        """Values of each parameter in one row (the gather's segments)."""
        return [c * (p.numel() // p.shape[0]) for c, p in zip(self.chunks, self.params)]

    def rows(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """(N, S): the unit's layout of per-parameter tensors (gradients or weights)."""
        parts = []
        for g, c in zip(tensors, self.chunks):
            pad = c * self.n - g.shape[0]
            gp = torch.cat([g, g.new_zeros((pad,) + g.shape[1:])]) if pad else g
            parts.append(gp.reshape(self.n, -1))
        return torch.cat(parts, dim=1)

    def unrows(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """Inverse of :meth:`rows`: per-parameter tensors from (N, S)."""
        out, off = [], 0
        for p, w in zip(self.params, self.segments):
            full = rows[:, off:off + w].reshape((-1,) + p.shape[1:])
            out.append(full[:p.shape[0]])
            off += w
        return out
