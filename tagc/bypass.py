"""The automatic bypass: a unit compresses only while compressing is faster (``bypass_every``).

On a link fast enough that the plain reduce-scatter costs less than TAGC's codec plus
its exchange (loopback, NVLink, an idle datacenter fabric), compression makes the step
slower.  :class:`Bypass` measures both paths of one unit and picks the faster:

- The ``every``-th reduction of the unit is a *probe*: it takes the path not taken
  now, so both paths have a recent time (the first probe times the plain path).
  Each probe that confirms the path doubles the distance to the next one (up to
  ``64 * every``): a probe of the slower path is a slow step, and a stable choice
  needs few of them; a probe that switches paths resets the distance.
- Each call's wall time on the path it took is recorded (CPU: ``perf_counter``
  around the call; CUDA: events on the codec stream, read at the probe, which
  waits for the probe's own work: one host sync per ``every`` reductions).
- After a probe the ranks all-reduce (SUM) the two mean times, an 16-byte control
  message, and every rank compares the same sums: the decision is identical on
  every rank whatever each measured, so no rank waits in a collective the
  others skip.  Compression stays on unless its summed time exceeds the plain
  one's.

A bypassed call loses nothing: it sends ``g + residual`` through the plain
reduce-scatter and empties the residual (EF21: the exact gradient sum becomes the
owner's estimate, and each rank's ``h`` its own gradient), so error feedback stays
exact across switches.  The decision is not checkpointed: a resumed run starts
compressing and probes again.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

PATHS = ("compress", "plain")


class Bypass:
    """The timing-based choice between compressing and the plain path, one unit.

    Args:
        every: the distance to the first probe, and after each switch (>= 2).
        clock: seconds as a float (tests inject a fake one).
    """

    def __init__(self, every: int, clock: Callable[[], float] = time.perf_counter) -> None:
        if every < 2:
            raise ValueError(f"bypass_every: a probe needs >= 2 reductions between, got {every}")
        self.every, self.clock = every, clock
        self.compress = True
        self.interval = every  # reductions from one probe to the next
        self.since = 0         # reductions since the last probe
        self.sums: Dict[str, float] = {p: 0.0 for p in PATHS}
        self.counts: Dict[str, int] = {p: 0 for p in PATHS}
        self.last: Dict[str, Optional[float]] = {p: None for p in PATHS}
        self.pending: List[Any] = []  # CUDA (path, start event, end event)
        self.decisions = 0

    def _probe(self) -> bool:
        return self.since == self.interval - 1

    def next_path(self) -> str:
        """The path of the coming call: the current choice, or the other on a probe."""
        cur = "compress" if self.compress else "plain"
        if self._probe():
            return "plain" if cur == "compress" else "compress"
        return cur

    @contextmanager
    def timed(self, path: str, cuda: bool) -> Iterator[None]:
        """Measure the call run inside on ``path`` (CUDA: on the current stream)."""
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((path, start, end))
            return
        t0 = self.clock()
        yield
        self._add(path, self.clock() - t0)

    def _add(self, path: str, seconds: float) -> None:
        self.sums[path] += seconds
        self.counts[path] += 1

    def finish(self, comm: Any, device: torch.device) -> None:
        """After each call: on a probe, agree with the other ranks on the path.

        Args:
            comm: the call's collectives (``all_reduce`` counted as control).
            device: where the 16-byte agreement tensor lives (the gradient's).
        """
        probe = self._probe()
        self.since += 1
        if not probe:
            return
        self.since = 0
        for path, start, end in self.pending:
            end.synchronize()  # once per probe: the probe's own work must be timed
            self._add(path, start.elapsed_time(end) / 1e3)
        self.pending.clear()
        for p in PATHS:
            if self.counts[p]:
                self.last[p] = self.sums[p] / self.counts[p]
            self.sums[p], self.counts[p] = 0.0, 0
        if self.last["compress"] is None or self.last["plain"] is None:
            return
        t = torch.tensor([self.last["compress"], self.last["plain"]], dtype=torch.float64,
                         device=device)
        comm.all_reduce(t, control=True)
        # identical sums on every rank: an identical decision
        compress = bool(t[0] <= t[1])
        self.interval = self.every if compress != self.compress else \
            min(2 * self.interval, 64 * self.every)
        self.compress = compress
        self.decisions += 1
