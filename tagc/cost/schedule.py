"""One FSDP2 step unit by unit, with TAGC's worker thread beside the compute.

With ``fsdp_overlap`` (CPU tensors, FSDP2 over one group; ``tagc/overlap.py``) every
collective of the shard group runs on one worker thread, in the order the model thread
submits it: each unit's parameter all-gather (FSDP2 prefetches the next unit's, in the
forward by the order TAGC records, in the backward by itself) and each unit's gradient
exchange, which the backward's final callback waits for.  The model thread computes
and waits only where a unit's gathered parameters are needed.  :func:`worker_step_s`
replays that protocol as two clocks: a job starts when the worker is free and the
model thread has submitted it; a wait moves the model thread to the job's end.

Assumptions, none measured here (COST_MODEL.md lists them): a unit's compute is
proportional to its parameters (the root's tied ``wte`` is the ``lm_head`` matmul, at
the forward's end and the backward's start); the backward computes twice the
forward's (the optimizer step is folded into both); the worker's codec and the
compute do not slow each other down.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

# the forward's share of a step's compute: backward = 2 x forward (two matmuls per
# forward matmul, for the input's and the weight's gradients)
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class UnitJobs:
    """One FSDP unit's work in a step.

    Args:
        root: the root unit (gathered first, its compute at the forward's end).
        share: its fraction of the step's compute, in [0, 1].
        gather_s: one parameter all-gather on the worker (collective and codec).
        grad_s: its gradient exchange on the worker (collective and codec).
        regather_s: its backward re-gather (None: as ``gather_s``; ``gather_delta``
            on gloo sends only the flags there).
    """

    root: bool
    share: float
    gather_s: float
    grad_s: float
    regather_s: Optional[float] = None

    def __post_init__(self) -> None:
        for k in ("share", "gather_s", "grad_s"):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)!r}")
        if self.regather_s is not None and not self.regather_s >= 0:
            raise ValueError(f"regather_s must be >= 0 or None, got {self.regather_s!r}")

    @property
    def back_gather_s(self) -> float:
        """The backward re-gather's seconds."""
        return self.gather_s if self.regather_s is None else self.regather_s


class _Clocks:
    """The model thread's and the worker's clocks (seconds since the step began)."""

    def __init__(self) -> None:
        self.model = 0.0
        self.worker = 0.0
        self.ends: List[float] = []

    def submit(self, seconds: float) -> int:
        """Queue a job on the worker; returns its id."""
        self.worker = max(self.worker, self.model) + seconds
        self.ends.append(self.worker)
        return len(self.ends) - 1

    def wait(self, job: int) -> None:
        self.model = max(self.model, self.ends[job])

    def compute(self, seconds: float) -> None:
        self.model += seconds


def worker_step_s(units: Sequence[UnitJobs], compute_s: float, reshard: bool = True,
                  deferred: bool = True) -> float:
    """The step's time with every collective on TAGC's worker.

    Args:
        units: the units in forward order, the root first.
        compute_s: the step's compute (forward, backward and optimizer).
        reshard: FSDP2's ``reshard_after_forward`` for every unit (False: gathered once,
            in the forward, and kept for the backward).
        deferred: the gradient exchanges finish after the hook returns (False: each is
            waited for at once, as under a bf16 reduce dtype, ``tagc.fsdp2.deferrable``).
    Returns:
        seconds from the first gather to the last exchange's end.
    Raises:
        ValueError: no units, or the first is not the root.
    """
    if not units or not units[0].root or any(u.root for u in units[1:]):
        raise ValueError("units must start with the root, and hold one root")
    c = _Clocks()
    fwd = [u.share * compute_s * FORWARD_SHARE for u in units]
    bwd = [u.share * compute_s * (1 - FORWARD_SHARE) for u in units]
    n = len(units)
    # forward: the root's gather, then each unit waits for its own and prefetches the
    # next before it computes (the root's pre-forward prefetches the first block)
    c.wait(c.submit(units[0].gather_s))
    nxt = c.submit(units[1].gather_s) if n > 1 else -1
    for i in range(1, n):
        c.wait(nxt)
        if i + 1 < n:
            nxt = c.submit(units[i + 1].gather_s)
        c.compute(fwd[i])
    c.compute(fwd[0])  # the root's own compute (lm_head) ends the forward
    # backward, in reverse: each unit re-gathered (the next one prefetched at its
    # pre-backward hook), computed, its exchange queued after that prefetch
    jobs: List[int] = []
    if reshard:
        c.wait(c.submit(units[0].back_gather_s))
        nxt = c.submit(units[n - 1].back_gather_s) if n > 1 else -1
    c.compute(bwd[0])
    for i in range(n - 1, 0, -1):
        if reshard:
            c.wait(nxt)
            if i > 1:
                nxt = c.submit(units[i - 1].back_gather_s)
        c.compute(bwd[i])
        jobs.append(c.submit(units[i].grad_s))
        if not deferred:
            c.wait(jobs[-1])
    # the root's exchange: its tied wte is reduced after the embedding's backward, the
    # step's last op; the final callback waits for every queued exchange
    jobs.append(c.submit(units[0].grad_s))
    for j in jobs:
        c.wait(j)
    return c.model
