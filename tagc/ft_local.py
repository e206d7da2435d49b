"""TAGC's local steps over a torchft quorum: :class:`FTLocalSteps` (docs/TORCHFT.md).

The outer loop is :class:`tagc.local.LocalSteps`'s (fragments of contiguous units,
their offsets, ``outer_overlap``'s streamed syncs, ``outer_mix``'s merge, Nesterov
momentum, the non-finite skip, the agreement check); what changes is who takes part.
Each sync is one torchft step:

1. **quorum** (at the sync's launch): ``manager.start_quorum()``.  A replica behind
   the quorum's step heals from a peer there (torchft's recovery), which brings the
   outer state with the model and optimizer (:meth:`FTLocalSteps.state_dict`: every
   unit's anchor ``start``, momentum and step counters); the fragment to sync is then
   read again from the healed counters, so the healed replica syncs the peer's.
2. **exchange**: the fragment's pseudo-gradient (its units' end to end) through
   :class:`tagc.ft.FTAllReduce` (the codec of TAGC's HSDP route, sized by the current
   quorum at every call; a leaver's feedback dropped, a joiner's zero), averaged over
   the quorum's R; its feedback state is keyed by the fragment.
3. **vote** (at once, or after ``outer_overlap`` steps): the new (momentum, start) is
   computed first, its checksum compared over the quorum, then ``should_commit()``.
   Committed: applied, as without torchft.  Not committed (a peer failed anywhere in
   the sync): the outer state stays, the fragment's shards go back to their last
   sync on every replica (torchft's DiLoCo does the same), and TAGC's feedback rolls
   back with the step; the schedule goes on.

A replica alone in its quorum averages over itself (its own pseudo-gradient, nothing
sent) and still takes the outer step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from .config import TAGCConfig
from .ft import FTAllReduce, QuorumSource
from .local import LocalSteps

logger = logging.getLogger(__name__)


class OuterUnit:
    """One unit's outer state where no replica reducer holds it (the quorum's
    reducers come and go with R): the attributes :class:`LocalSteps` reads.

    Args:
        name: the unit's name, for messages.
        shard_numel: elements of the unit's shard.
        device: where the shard lives.
    """

    def __init__(self, name: str, shard_numel: int, device: torch.device) -> None:
        self.name, self.shard_numel, self.device = name, shard_numel, device
        self.outer_start: Optional[torch.Tensor] = None
        self.outer_momentum: Optional[torch.Tensor] = None
        self.outer_inner: Optional[torch.Tensor] = None
        self.outer_avg: Optional[torch.Tensor] = None


class FTManagerLike(QuorumSource):
    """What :class:`FTLocalSteps` needs of a ``torchft.Manager`` beyond
    :class:`~tagc.ft.QuorumSource`."""

    def start_quorum(self) -> None: ...  # noqa: D102 - torchft's

    def register_state_dict_fn(self, key: str, load_state_dict: Any,
                               state_dict: Any) -> None: ...  # noqa: D102


class FTLocalSteps(LocalSteps):
    """Local steps (``outer_every``, streamed or not) whose outer syncs run over a
    torchft quorum (module doc).

    Args:
        mods: the units: FSDP2 modules sharded inside the replica group (the same
            layout in every group), or plain modules of a one-process replica; their
            trained parameters must not overlap.
        cfg: the config (``outer_every`` > 0; the same on every replica).
        manager: the ``torchft.Manager`` (``use_async_quorum=False``); its
            ``register_state_dict_fn`` receives the outer state under ``key``.
        pg: the process group handed to the manager.
        optimizer: the inner optimizer; a step post-hook counts its steps.
        key: the state dict key on the manager.
    Raises:
        ValueError: ``outer_every`` is 0, no units, a unit without trained
            parameters, or units that share parameters.
        NotImplementedError: as :class:`~tagc.ft.FTAllReduce`.
    """

    def __init__(self, mods: List[Any], cfg: TAGCConfig, manager: FTManagerLike, pg: Any,
                 optimizer: torch.optim.Optimizer, key: str = "tagc_local_steps") -> None:
        if not cfg.outer_every:
            raise ValueError("FTLocalSteps: the config has no local steps (outer_every 0)")
        if not mods:
            raise ValueError("FTLocalSteps: no units")
        self.manager, self.pg = manager, pg
        self.ft = FTAllReduce(manager, pg, cfg)
        self.sync_s: List[float] = []  # each sync: its exchange's first call to its vote
        self.commits = self.failures = 0
        self._t0: Optional[float] = None
        self._healed = False
        units, seen = [], set()
        for i, m in enumerate(mods):
            storage = self._storage(m)
            if not storage:
                raise ValueError(f"FTLocalSteps: unit {i} has no trained parameters")
            mine = {t.data_ptr() for t in storage}
            if mine & seen:  # a parameter synced twice would take two outer steps
                raise ValueError(f"FTLocalSteps: unit {i} shares parameters with an earlier "
                                 "unit (pass disjoint modules, e.g. the leaves)")
            seen |= mine
            units.append(OuterUnit(f"unit{i}", sum(t.numel() for t in storage),
                                   storage[0].device))
        self._setup(mods, units, cfg, optimizer)
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    @property
    def replicas(self) -> int:  # type: ignore[override]
        """R of the current quorum."""
        return self.manager.num_participants()

    def _common(self, start: torch.Tensor) -> None:
        # every replica builds the same weights from the seed, or heals from a peer at
        # its first quorum; the first vote's checksum catches one that did neither
        return

    # ------------------------------------------------------------------ one sync
    def _launch(self, p: int, t: int) -> None:
        self.manager.start_quorum()
        if self._healed:  # the peer's counters: its fragment, its step
            self._healed = False
            t = self.step
            due = self._due(t)
            if due is None:
                raise RuntimeError(f"FTLocalSteps: healed to inner step {t}, where no "
                                   "fragment syncs (another outer_every/outer_fragments?)")
            p = due
        self._t0 = time.perf_counter()
        super()._launch(p, t)

    def _reduce(self, idx: List[int], deltas: List[torch.Tensor]) -> None:
        # one exchange per fragment, its units' pseudo-gradients end to end (a slow
        # link pays its round trips once, as torchft's bucketed DiLoCo); errors are
        # reported to the manager, not raised: the vote fails everywhere
        flat = torch.cat(deltas) if len(deltas) > 1 else deltas[0]
        self.ft.allreduce(flat, key=self.fragments.index(idx))
        o = 0
        for i, d in zip(idx, deltas):
            if flat is not d:
                d.copy_(flat[o:o + d.numel()])
            o += d.numel()
            self.units[i].outer_avg = d

    def _merge(self, p: int, avgs: List[torch.Tensor]) -> bool:
        idx = self.fragments[p]
        new = self._outer(idx, avgs)
        if not self.manager.errored():
            self._check_agree([self.units[i].outer_start for i in idx]
                              if new is None else [start for _, start in new])
        ok = self.ft.should_commit()
        if self._t0 is not None:
            self.sync_s.append(time.perf_counter() - self._t0)
            self._t0 = None
        if ok:
            self.commits += 1
            self._apply(p, new)
            return new is not None
        self.failures += 1
        logger.warning("TAGC local steps over torchft: the sync of fragment %d was not "
                       "committed (%s); its shards back at their last sync", p,
                       self.manager.errored() or "a peer failed")
        for i in idx:
            self.units[i].outer_avg = None
            self._write(i, self.units[i].outer_start)
        return False

    def _gather(self, mine: torch.Tensor) -> List[torch.Tensor]:
        world = self.replicas
        if world == 1:
            return [mine]
        everyone = [torch.empty_like(mine) for _ in range(world)]
        try:
            self.pg.allgather([everyone], [mine], AllgatherOptions()).wait()
        except Exception as e:  # a failed peer: no verdict, and the vote fails
            self.manager.report_error(e)
            return [mine]
        return everyone

    def outer_step(self) -> bool:
        """Sync every fragment now, each one torchft step (a quorum, the exchange, a
        vote); every replica must call it at the same point.

        Returns:
            True when every fragment's step was committed and applied.
        """
        if self._flight is not None or any(u.outer_avg is not None for u in self.units):
            self._merge_flight()
        ok = True
        for p, idx in enumerate(self.fragments):
            self.manager.start_quorum()
            self._healed = False
            self._t0 = time.perf_counter()
            deltas = [self.units[i].outer_start - self._shard(i) for i in idx]
            self._reduce(idx, deltas)
            ok = self._merge(p, deltas) and ok
        return ok

    # ------------------------------------------------------------------ recovery
    def state_dict(self, committed: bool = False) -> Dict[str, Any]:
        """The outer state a healing peer loads: every unit's anchor, momentum and
        counters (copies: the step goes on while a peer reads them).  The feedback
        state is not in it: a peer's residual is its own unsent error.

        Args:
            committed: for a checkpoint: a sync in flight (launched, not voted) is
                left out, as if never launched; its pseudo-gradient stays in the
                shards, and its fragment's next sync sends it.
        Returns:
            ``{"units": [{"start", "momentum", "inner"}, ...]}``.
        Raises:
            RuntimeError: a sync in flight and not ``committed`` (a quorum is taken at
                a launch, never inside one).
        """
        if self._flight is not None and not committed:
            raise RuntimeError("FTLocalSteps: a state dict was asked for with a sync in "
                               "flight (quorums are taken at a launch, never inside one)")
        return {"units": [{"start": u.outer_start.detach().clone(),
                           "momentum": u.outer_momentum.detach().clone(),
                           "inner": torch.tensor([int(u.outer_inner[0]), -1])}
                          for u in self.units]}

    def load_state_dict(self, sd: Dict[str, Any], healed: bool = True) -> None:
        """Load a peer's :meth:`state_dict` (torchft's recovery calls it), or this
        replica's own from a checkpoint.

        Args:
            sd: the outer state.
            healed: a peer's, loaded at a quorum: the fragment to sync is read again
                from its counters (False: a checkpoint's, loaded before training).
        Raises:
            ValueError: another number of units or another shard size.
        """
        got = sd["units"]
        if len(got) != len(self.units):
            raise ValueError(f"FTLocalSteps: the peer has {len(got)} units, this replica "
                             f"{len(self.units)}")
        for u, s in zip(self.units, got):
            if s["start"].numel() != u.shard_numel:
                raise ValueError(f"FTLocalSteps: unit {u.name!r} has {u.shard_numel} "
                                 f"elements, the peer's {s['start'].numel()}")
        for u, s in zip(self.units, got):
            u.outer_start = s["start"].to(u.device, torch.float32).clone()
            u.outer_momentum = s["momentum"].to(u.device, torch.float32).clone()
            u.outer_inner = s["inner"].to("cpu", torch.int64).clone()
            u.outer_avg = None
        self._healed = healed

    def stats(self) -> Dict[str, Any]:
        """Syncs committed and not, bytes sent (and fp32's ring figure), and the mean
        sync time in seconds."""
        return {"commits": self.commits, "failures": self.failures,
                "wire_bytes": self.ft.wire_bytes,
                "default_wire_bytes": self.ft.default_wire_bytes,
                "sync_s_mean": (sum(self.sync_s) / len(self.sync_s)
                                if self.sync_s else float("nan"))}


__all__: List[str] = ["FTLocalSteps", "OuterUnit"]
