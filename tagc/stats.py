"""Per-unit counters: what each reduction sent, chose and recovered (``TAGCState.stats()``).

One API for every counter, :meth:`UnitStats.add`: a host number, or (CUDA) a 1-element
device tensor that stays on the device until :meth:`UnitStats.as_dict` reads it, so the
hot path never waits for the GPU.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .device import gate

COUNTERS = ("calls", "compressed_calls", "bypassed_calls", "guard_resets", "plain_calls",
            "dense_step_calls", "nonfinite_fallbacks",
            # residuals found not finite at a call and reset (UnitReducer._guard_residuals)
            "residual_resets",
            "bytes_handed", "wire_bytes", "default_wire_bytes", "control_bytes",
            "unpeeled", "recovered", "union_size", "shard_slots",
            "collision_dropped", "collision_dropped_l1",
            # auto mode: shard messages sent in each coding (tagc.h tagc_coding)
            "coded_ef", "coded_bitmap", "coded_dense",
            # parameter all-gathers (TAGCConfig.gather), apart from the gradient's bytes
            "gather_calls", "gather_quantized_calls", "gather_exact_calls",
            "gather_unchanged_calls", "gather_nonfinite", "gather_wire_bytes",
            "gather_default_wire_bytes")


class UnitStats:
    """The counters of one unit since registration or :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero everything."""
        self.counters: Dict[str, float] = {c: 0 for c in COUNTERS}
        self.device: Dict[str, torch.Tensor] = {}
        self.vectors: Dict[Tuple[str, ...], torch.Tensor] = {}
        self.collectives: Dict[str, Dict[str, int]] = {}

    def add(self, name: str, value: Union[int, float, torch.Tensor],
            ok: Optional[torch.Tensor] = None) -> None:
        """Add to a counter.

        Args:
            name: one of :data:`COUNTERS`.
            value: a host number, or a 1-element device tensor (accumulated on
                the device).
            ok: CUDA: the call's "every rank's gradient is finite" flag; the value
                counts only where it is true (a host number then joins the device
                counter: a poisoned call counts nothing, its sizes neither).
        """
        if isinstance(value, torch.Tensor):
            v = value.reshape(-1)[:1].to(torch.float64, copy=True)
            if ok is not None:
                v = gate(v, ok)
            acc = self.device.get(name)
            self.device[name] = v if acc is None else acc.add_(v)
        elif ok is not None:
            acc = self.device.get(name)
            if acc is None:
                acc = self.device[name] = torch.zeros(1, dtype=torch.float64, device=ok.device)
            acc.add_(ok.reshape(-1)[:1], alpha=value)
        else:
            self.counters[name] += value

    def vector(self, names: Tuple[str, ...], device: torch.device) -> torch.Tensor:
        """A device int64 vector that kernels add to directly, entry i counting
        ``names[i]`` (created zero on first use): the counts of a call without a
        torch op of their own (``_tagc.quant_unit_encode``'s ``counts``).

        Args:
            names: counters of :data:`COUNTERS`.
            device: the CUDA device.
        Returns:
            the vector, read by :meth:`as_dict`.
        """
        t = self.vectors.get(names)
        if t is None:
            t = self.vectors[names] = torch.zeros(len(names), dtype=torch.int64, device=device)
        return t

    def record(self, op: str, handed: int, wire: float, control: bool = False) -> None:
        """One tensor handed to ``torch.distributed``.

        Args:
            op: the torch.distributed function.
            handed: bytes of the tensor handed to it.
            wire: bytes this rank sends for it on an ideal network.
            control: a control message (non-finite agreement, counts).
        """
        c = self.collectives.setdefault(op, {"calls": 0, "bytes": 0})
        c["calls"] += 1
        c["bytes"] += int(handed)
        if op == "irecv":  # a receive buffer: listed, but nothing this rank sends
            return
        self.counters["bytes_handed"] += int(handed)
        self.counters["wire_bytes"] += wire
        if control:
            self.counters["control_bytes"] += int(handed)

    def as_dict(self) -> Dict[str, Any]:
        """Every counter (device values read here: the only host syncs), the
        collectives, and the derived ``density`` and ``wire_ratio``."""
        d: Dict[str, Any] = dict(self.counters)
        for name, t in self.device.items():
            v = float(t.item())
            d[name] += int(v) if name != "collision_dropped_l1" else v
        for names, t in self.vectors.items():
            for name, v in zip(names, t.tolist()):
                d[name] += v
        d["collectives"] = {k: dict(v) for k, v in self.collectives.items()}
        derive(d)
        return d


def derive(d: Dict[str, Any]) -> None:
    """Add ``density``, ``wire_ratio`` and ``gather_wire_ratio`` from the counters."""
    slots = d["shard_slots"]
    d["density"] = d["union_size"] / slots if slots else 0.0
    dw = d["default_wire_bytes"]
    d["wire_ratio"] = d["wire_bytes"] / dw if dw else 0.0
    gw = d["gather_default_wire_bytes"]
    d["gather_wire_ratio"] = d["gather_wire_bytes"] / gw if gw else 0.0


def total(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Sum of several units' :meth:`UnitStats.as_dict` (plus ``units``: how many)."""
    tot: Dict[str, Any] = {c: 0 for c in COUNTERS}
    coll: Dict[str, Dict[str, int]] = {}
    for e in entries:
        for c in COUNTERS:
            tot[c] += e[c]
        for op, v in e["collectives"].items():
            cc = coll.setdefault(op, {"calls": 0, "bytes": 0})
            cc["calls"] += v["calls"]
            cc["bytes"] += v["bytes"]
    tot["collectives"] = coll
    tot["units"] = len(entries)
    derive(tot)
    return tot
