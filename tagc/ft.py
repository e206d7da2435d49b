"""TAGC inside torchft: its compressed all-reduce (:class:`FTAllReduce`) and its local
steps (:class:`FTLocalSteps`) over a quorum (docs/TORCHFT.md).

torchft's ``Manager`` forms a quorum of replicas every step and reconfigures its process
group to it.  :class:`FTAllReduce` has ``Manager.allreduce``'s signature (what
``torchft.local_sgd.DiLoCo`` calls) and runs custom HSDP's replica reducers
(tagc/hsdp.py) over the current quorum: R, this replica's rank and the reducer's step
are read from the manager at every call, the reducer is rebuilt when (R, rank) changes,
its feedback state carried over by position (:func:`carry_feedback`), and every change
to that state is a transaction that ``should_commit()`` commits or rolls back.
:class:`FTManager` hands it to ``DiLoCo`` as its manager.

:class:`FTLocalSteps` runs TAGC's own local steps over the quorum: the outer loop of
:class:`tagc.local.LocalSteps` (fragments of contiguous units, their offsets,
``outer_overlap``'s streamed syncs, ``outer_mix``'s merge, Nesterov momentum, the
non-finite skip, the agreement check), each fragment's sync one torchft step:

1. **quorum** (at the sync's launch): ``manager.start_quorum()``.  A replica behind
   the quorum's step heals from a peer there (torchft's recovery), which brings the
   outer state with the model and optimizer (:meth:`FTLocalSteps.state_dict`: every
   unit's anchor ``start``, momentum and step counters); the fragment to sync is then
   read again from the healed counters, so the healed replica syncs the peer's.
2. **exchange**: the fragment's pseudo-gradient (its units' end to end) through
   :class:`FTAllReduce`, averaged over the quorum's R; its feedback state is keyed by
   the fragment.
3. **vote** (at once, or after ``outer_overlap`` steps): the new (momentum, start) is
   computed first, its checksum compared over the quorum, then ``should_commit()``.
   Committed: applied, as without torchft.  Not committed (a peer failed anywhere in
   the sync): the sync is discarded on every replica, the outer state stays and TAGC's
   feedback rolls back with the step; the shards keep their local steps, so the
   fragment's next sync sends them with the next round's (torchft's DiLoCo drops
   them instead); the schedule goes on.

A replica alone in its quorum averages over itself (its own pseudo-gradient, nothing
sent) and still takes the outer step.

Nothing here imports torchft: the manager and the process group are duck-typed
(:class:`QuorumSource`, anything with torch's ``ProcessGroup`` methods).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from datetime import timedelta
from typing import Any, Dict, Hashable, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from .comm import Comm, pair_all_gather
from .config import TAGCConfig
from .device import CodecStreams, Exec
from .hsdp import GatherReducer, ReplicaReducer, TwoPhaseReducer, allreduce_form
from .local import LocalSteps
from .selection import UnitSpec

logger = logging.getLogger(__name__)


class QuorumSource(Protocol):
    """What :class:`FTAllReduce` reads from a ``torchft.Manager`` (public methods only)."""

    def num_participants(self) -> int: ...  # noqa: D102 - torchft's

    def participating_rank(self) -> Optional[int]: ...  # noqa: D102

    def current_step(self) -> int: ...  # noqa: D102

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool: ...  # noqa: D102

    def report_error(self, e: Exception) -> None: ...  # noqa: D102

    def errored(self) -> Optional[Exception]: ...  # noqa: D102


class PGComm(Comm):
    """:class:`~tagc.comm.Comm` over a process group that ``torch.distributed``'s
    registry does not know (torchft's reconfigurable groups).

    ``dist.all_reduce``, ``all_to_all_single`` and ``isend``/``irecv`` with group ranks
    call the group's own methods and work on such a group; the base class's all-gather
    (``dist.get_backend``, a flat all-gather), reduce (a global rank) and reduce-scatter
    (torchft's gloo group has none) do not, so they are issued here through methods
    every group has, and counted as what they send.
    """

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's ``inp`` into row r of ``out``: one exchange with the peer at
        two CPU ranks (as :func:`tagc.comm.exchanges_pairwise` decides on gloo), else
        the group's list all-gather into views of ``out``'s rows."""
        nb = inp.numel() * inp.element_size()
        if self.world == 2 and inp.device.type == "cpu":
            self.stats.record("pair_all_gather", nb, nb)
            pair_all_gather(out, inp, self.rank, self.group)
            return
        self.stats.record("allgather", nb, (self.world - 1) * nb)
        rows = list(out.view(self.world, -1).unbind(0))
        self.group.allgather([rows], [inp.reshape(-1)], AllgatherOptions()).wait()

    def reduce(self, t: torch.Tensor, dst_group_rank: int, async_op: bool = False) -> Any:
        """A SUM all-reduce in place of the reduce: ``dst_group_rank`` gets the same
        sum (the others get it too; counted as the all-reduce it is)."""
        return self.all_reduce(t, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """The SUM reduce-scatter as an all-reduce of a copy, this rank's row kept."""
        full = inp.clone()
        self.all_reduce(full)
        out.copy_(full.view(self.world, -1)[self.rank])


class _OnGroup:
    """Makes a replica reducer issue its collectives through :class:`PGComm`: the
    reducer builds its ``Comm`` per call and hands it to ``_route`` and ``after``, the
    two places that use it."""

    def _pg_comm(self, comm: Comm) -> PGComm:
        return PGComm(comm.group, comm.rank, comm.world, comm.stats, comm.dev)

    def _route(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        super()._route(self._pg_comm(comm), dev, inp, out)  # type: ignore[misc]

    def after(self, comm: Comm, dev: Exec, out: torch.Tensor, step: int) -> None:
        super().after(self._pg_comm(comm), dev, out, step)  # type: ignore[misc]


class FTGatherReducer(_OnGroup, GatherReducer):
    """:class:`~tagc.hsdp.GatherReducer` over a torchft process group."""


class FTTwoPhaseReducer(_OnGroup, TwoPhaseReducer):
    """:class:`~tagc.hsdp.TwoPhaseReducer` over a torchft process group."""


def build_reducer(cfg: TAGCConfig, key: Hashable, group: Any, rank: int, world: int,
                  numel: int, device: torch.device, streams: CodecStreams) -> ReplicaReducer:
    """The replica reducer of one flat tensor for one quorum, of the form
    :func:`~tagc.hsdp.allreduce_form` picks (the same on every replica).

    Args:
        cfg: the config.
        key: the tensor's name; its CRC is the unit index the hash seeds take, the
            same in every process.
        group: the quorum's process group.
        rank, world: this replica's rank and R.
        numel: the tensor's elements, L.
        device: where the tensor lives.
        streams: the codec streams.
    Returns:
        the reducer (its ``divide`` left at 1).
    """
    index = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    spec = UnitSpec(name=f"ft:{key}", index=index, numel=numel, flat_numel=numel,
                    selected_numel=numel, device=device)
    if allreduce_form(cfg, world, True, numel) == "gather":
        return FTGatherReducer(cfg, spec, group, rank, world, streams, numel)
    spec = dataclasses.replace(spec, flat_numel=world * math.ceil(numel / world))
    return FTTwoPhaseReducer(cfg, spec, group, rank, world, streams, numel)


def carry_feedback(old: ReplicaReducer, new: ReplicaReducer) -> None:
    """Move ``old``'s feedback state into ``new``, built for another (R, rank, form).

    Both are in sum space.  The to-the-owner residual is indexed by position in the
    flat tensor (owners only cut it into chunks), so its first L entries carry over
    as they are; an owner's ``residual_out`` (what its code of its chunk of the sum
    left) is added at that chunk's positions, so the new owners of those positions
    get it with the next call.  Padding never holds anything (its input is always 0).
    Coded residuals (``residual_code``) are decoded and coded again.  ``old`` is left
    as it was.

    Args:
        old: the reducer of the previous quorum.
        new: the fresh reducer of this one (no state yet).
    """
    if not old.keeps_feedback or old.residual is None:
        return
    dev = Exec(old.residual)
    held = old._open_codes(dev)  # fp32 working copies of coded residuals
    try:
        length = old.shard_numel
        owed = torch.zeros(new.flat_numel, dtype=torch.float32, device=old.residual.device)
        owed[:length] += old.residual.float()[:length]
        out = getattr(old, "residual_out", None)
        if out is not None:
            start = old.rank * old.chunk
            stop = min(start + old.chunk, length)
            if stop > start:
                owed[start:stop] += out.float()[:stop - start]
    finally:
        old._close_codes(dev, held, False)  # the old codes back, untouched
    if new.coded_residuals():
        new.residual = owed
        new._close_codes(dev, {"residual": None}, True)  # codes the working copy
    else:
        new.residual = owed.to(new.cfg.residual_dtype)


@dataclasses.dataclass
class _Held:
    """One tensor's state before its first call of a step: the reducer object then
    (None: none yet) and clones of its state buffers."""

    reducer: Optional[ReplicaReducer]
    buffers: Dict[str, Optional[torch.Tensor]]


class _Done(dist.Work):
    """A finished all-reduce, as torchft's ``Manager.allreduce`` returns it (``wait``,
    ``get_future``): the exchange runs when called."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone()


class FTAllReduce:
    """TAGC's compressed all-reduce over a torchft quorum, ``Manager.allreduce``'s
    drop-in (docs/TORCHFT.md).

    Call :meth:`should_commit` in place of ``manager.should_commit()``: it commits or
    rolls back the feedback state with the step.

    Args:
        manager: a ``torchft.Manager`` (synchronous quorum) or anything with its
            :class:`QuorumSource` methods.
        pg: the process group the manager reconfigures (the one handed to it).
        cfg: the config (the same on every replica).
    Raises:
        NotImplementedError: EF21 or ``bypass_every`` (see docs/TORCHFT.md).
    """

    def __init__(self, manager: QuorumSource, pg: Any, cfg: TAGCConfig) -> None:
        if cfg.ef21:
            raise NotImplementedError("FTAllReduce: EF21's estimates are shared by every "
                                      "replica and cannot follow a quorum change yet")
        if cfg.bypass_every:
            raise NotImplementedError("FTAllReduce: bypass_every keeps per-replica timing "
                                      "state a joiner lacks; set it to 0")
        self.manager, self.pg, self.cfg = manager, pg, cfg
        self.streams = CodecStreams()
        self.units: Dict[Hashable, ReplicaReducer] = {}
        self._held: Dict[Hashable, _Held] = {}
        self._calls = 0  # calls since the last commit/rollback: the default keys
        self._open_step: Optional[int] = None  # the step of the open transaction
        # the manager step the state belongs to after the last commit (None: none yet)
        self._state_step: Optional[int] = None
        # bytes this replica sent (and fp32's ring all-reduce would have), every call
        # that crossed a link, committed or not
        self.wire_bytes = self.default_wire_bytes = 0.0

    # ------------------------------------------------------------------ the exchange
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
                  key: Optional[Hashable] = None) -> dist.Work:
        """The mean (or sum) of ``tensor`` over the quorum, in place, compressed.

        As ``Manager.allreduce``: after an error every call is a no-op until the next
        quorum, and an error is reported to the manager (the step will not commit)
        instead of raised; ``tensor`` then holds garbage.

        Args:
            tensor: a floating tensor, the same shape on every replica.
            should_quantize: ignored (TAGC's config decides the codes).
            reduce_op: ``AVG`` or ``SUM``.
            key: the tensor's name, the same on every replica; None: the call's
                position since the last commit.
        Returns:
            a finished work whose future holds ``tensor``.
        Raises:
            ValueError: another reduce op, or a key seen with another size.
            RuntimeError: the quorum is not the group (async quorum, spares), or the
                last step was neither committed nor rolled back.
        """
        if reduce_op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"FTAllReduce: reduce_op must be AVG or SUM, got {reduce_op}")
        if key is None:
            key = self._calls
        self._calls += 1
        if self.manager.errored():
            return _Done(tensor)
        world, rank, step = self._quorum()
        self._begin(step)
        unit = self.units.get(key)
        if unit is not None and unit.shard_numel != tensor.numel():
            raise ValueError(f"FTAllReduce: tensor {key!r} has {tensor.numel()} elements, "
                             f"{unit.shard_numel} before")
        if key not in self._held:
            self._held[key] = _Held(unit, {} if unit is None else
                                    {n: _clone(getattr(unit, n))
                                     for n, _, _ in unit.state_buffers()})
        if world == 1:
            # nothing crosses a link: the tensor is its own mean, the state waits
            return _Done(tensor)
        try:
            if unit is None or (unit.world, unit.rank) != (world, rank):
                fresh = build_reducer(self.cfg, key, self.pg, rank, world, tensor.numel(),
                                      tensor.device, self.streams)
                if unit is not None:
                    carry_feedback(unit, fresh)
                    fresh.stats = unit.stats  # the counters go on
                self.units[key] = unit = fresh
            unit.step = step  # the same on every participant, a healed one too
            unit.divide = float(world) if reduce_op == dist.ReduceOp.AVG else 1.0
            before = (unit.stats.counters["wire_bytes"],
                      unit.stats.counters["default_wire_bytes"])
            try:
                unit.hook(tensor)
            finally:
                self.wire_bytes += unit.stats.counters["wire_bytes"] - before[0]
                self.default_wire_bytes += \
                    unit.stats.counters["default_wire_bytes"] - before[1]
        except Exception as e:  # the peers see a failed collective too
            self._restore(key)
            self.manager.report_error(e)
        return _Done(tensor)

    def _quorum(self) -> Tuple[int, int, int]:
        """(R, this replica's rank, the manager's step), checked against the group."""
        world = self.manager.num_participants()
        rank = self.manager.participating_rank()
        size = self.pg.size()
        if rank is None or world != size or not 0 <= rank < size:
            raise RuntimeError(
                f"FTAllReduce: {world} participants (this replica's rank {rank}) in a group "
                f"of {size}: every member of the group must participate (a synchronous "
                "quorum, Manager(use_async_quorum=False), world_size_mode DYNAMIC)")
        return world, rank, self.manager.current_step()

    def _begin(self, step: int) -> None:
        """Open the step's transaction; drop the state of another timeline."""
        if self._open_step is not None and self._open_step != step:
            raise RuntimeError("FTAllReduce: a new step began with the last one neither "
                               "committed nor rolled back; call FTAllReduce.should_commit() "
                               "in place of manager.should_commit()")
        if self._open_step is None and self._state_step is not None \
                and step != self._state_step:
            # healed from a peer (or steps committed without this replica): its state
            # belongs to steps the quorum has moved past, and a peer's would count twice
            self.units.clear()
        self._open_step = step

    # ------------------------------------------------------------------ transactions
    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """``manager.should_commit()``, then :meth:`commit` or :meth:`rollback`.

        Args:
            timeout: passed on.
        Returns:
            whether the step commits.
        """
        try:
            ok = self.manager.should_commit(timeout) if timeout is not None \
                else self.manager.should_commit()
        except Exception:
            self.rollback()
            raise
        if ok:
            self.commit()
        else:
            self.rollback()
        return ok

    def commit(self) -> None:
        """Keep the state the step's calls left (call after the manager committed)."""
        self._held.clear()
        self._calls = 0
        self._open_step = None
        self._state_step = self.manager.current_step()

    def rollback(self) -> None:
        """Put every tensor's state back as it was before the step's first call."""
        for key in list(self._held):
            self._restore(key)
        self._calls = 0
        self._open_step = None

    def _restore(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        if held.reducer is None:
            self.units.pop(key, None)
            return
        for name, t in held.buffers.items():
            setattr(held.reducer, name, t)
        self.units[key] = held.reducer

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """This replica's feedback state as of the last commit, for a checkpoint (its
        own unsent error, per tensor, with the quorum that left it): inside a step
        (exchanged, not yet voted) what the step's first call found.

        Returns:
            ``{"step": the manager step the state belongs to, "units": {key:
            {"world", "rank", "numel", "buffers": {attribute: tensor}}}}``, copies.
        """
        units: Dict[Hashable, Any] = {}
        for key, unit in self.units.items():
            held = self._held.get(key)
            if held is not None:  # touched by the open step: its state before
                if held.reducer is None:
                    continue
                unit, bufs = held.reducer, held.buffers
            else:
                bufs = {n: getattr(unit, n) for n, _, _ in unit.state_buffers()}
            units[key] = {"world": unit.world, "rank": unit.rank, "numel": unit.shard_numel,
                          "buffers": {n: _clone(t) for n, t in bufs.items()}}
        return {"step": self._state_step, "units": units}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (a replica resumed from its checkpoint):
        each tensor's reducer rebuilt for the quorum that left the state, so a call in
        another quorum carries it over as after any quorum change.

        Args:
            sd: a :meth:`state_dict` of this replica, the same config.
        Raises:
            ValueError: a buffer of another size (another model or config).
        """
        units: Dict[Hashable, ReplicaReducer] = {}
        for key, u in sd["units"].items():
            bufs = u["buffers"]
            device = next((t.device for t in bufs.values() if t is not None),
                          torch.device("cpu"))
            unit = build_reducer(self.cfg, key, self.pg, u["rank"], u["world"], u["numel"],
                                 device, self.streams)
            for name, numel, dtype in unit.state_buffers():
                t = bufs.get(name)
                if t is not None and (t.numel() != numel or t.dtype != dtype):
                    raise ValueError(f"FTAllReduce: the saved {name} of {key!r} has "
                                     f"{t.numel()} {t.dtype} entries, this config {numel} "
                                     f"{dtype}")
                setattr(unit, name, None if t is None else t.clone())
            units[key] = unit
        self.units, self._state_step = units, sd["step"]
        self._held.clear()
        self._calls, self._open_step = 0, None

    # ------------------------------------------------------------------ inspection
    def feedback_state(self, key: Hashable) -> Dict[str, Optional[torch.Tensor]]:
        """Clones of one tensor's state buffers (empty before its first call).

        Args:
            key: the tensor's key.
        Returns:
            attribute -> clone (None where not created yet).
        """
        unit = self.units.get(key)
        if unit is None:
            return {}
        return {n: _clone(getattr(unit, n)) for n, _, _ in unit.state_buffers()}

    def stats(self) -> Dict[Hashable, Dict[str, Any]]:
        """Every tensor's reducer counters (``UnitReducer.stats_dict``) with its R,
        rank and form."""
        return {k: {**u.stats_dict(), "replicas": u.world, "rank": u.rank, "form": u.FORM}
                for k, u in self.units.items()}


class FTManager:
    """A ``torchft.Manager`` whose ``allreduce`` and ``should_commit`` are an
    :class:`FTAllReduce`'s, everything else the manager's: what to hand
    ``torchft.local_sgd.DiLoCo`` as its manager.

    DiLoCo syncs fragment ``manager.current_step() % fragments`` (its
    ``_current_fragment``), each pseudo-gradient a fresh tensor in the fragment's
    parameter order, so a tensor's key is (that fragment, its call's position in the
    sync): equal-shaped fragments never share feedback state.

    Args:
        manager: the ``torchft.Manager`` (``use_async_quorum=False``, as DiLoCo wants).
        pg: the process group handed to it.
        cfg: the config.
        fragments: how many model fragments DiLoCo is given.
    """

    def __init__(self, manager: Any, pg: Any, cfg: TAGCConfig, fragments: int = 1) -> None:
        if fragments < 1:
            raise ValueError(f"FTManager: fragments must be >= 1, got {fragments}")
        self.manager, self.fragments = manager, fragments
        self.ft = FTAllReduce(manager, pg, cfg)
        self._calls = 0  # this sync's calls so far

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG) -> dist.Work:
        """:meth:`FTAllReduce.allreduce` keyed by (fragment, position in the sync)."""
        key = (self.manager.current_step() % self.fragments, self._calls)
        self._calls += 1
        return self.ft.allreduce(tensor, should_quantize, reduce_op, key=key)

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """:meth:`FTAllReduce.should_commit`; the next sync's keys start again."""
        self._calls = 0
        return self.ft.should_commit(timeout)

    def __getattr__(self, name: str) -> Any:
        # only what this class lacks: start_quorum, current_step, register_state_dict_fn...
        if name == "manager":  # not set yet: no recursion through this method
            raise AttributeError(name)
        return getattr(self.manager, name)


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
    :class:`QuorumSource`."""

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
        NotImplementedError: as :class:`FTAllReduce`.
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
            self._check_agree(self._starts(idx, new))
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
                       "committed (%s); its next sync sends this round's steps too", p,
                       self.manager.errored() or "a peer failed")
        for i in idx:
            self.units[i].outer_avg = None
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


class _UnitHook:
    """One FSDP2 unit's all-reduce hook: the unit's reduce-scatter output, averaged
    over the quorum by :meth:`FTAllReduce.allreduce` under the unit's index (the same
    on every replica)."""

    def __init__(self, ft: FTAllReduce, key: int) -> None:
        self.ft, self.key = ft, key

    def __call__(self, t: torch.Tensor) -> None:
        self.ft.allreduce(t, key=self.key)


def register(model: torch.nn.Module, cfg: TAGCConfig, manager: QuorumSource, pg: Any,
             optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """TAGC's codes between the replica groups of a torchft run: one call, before the
    first backward.

    Per step (``cfg.outer_every`` 0): each ``fully_shard``-ed unit's all-reduce hook
    (``FSDPModule.set_all_reduce_hook``, which FSDP2 calls after its reduce-scatter on
    a 1-D mesh) hands the unit's gradient shard to :meth:`FTAllReduce.allreduce`.
    FSDP2 keeps its own mean over the replica group's ranks; the hook divides by R, so
    the gradient is the mean over every rank of every participating replica, as native
    HSDP's.  Inside a replica group FSDP2 runs plain; the slow links are between groups.

    Local steps (``cfg.outer_every`` H): no hook; :class:`FTLocalSteps`
    counts the optimizer's steps and syncs the units' shards over the quorum (a quorum,
    the exchange and a vote per sync, from the optimizer's step hook).

    Args:
        model: the FSDP2 model (one replica group's, sharded over a 1-D mesh).
        cfg: the config (its gradient codec; the same on every replica).
        manager: the ``torchft.Manager`` (``use_async_quorum=False``).
        pg: the process group handed to it.
        optimizer: the inner optimizer (local steps only).
    Returns:
        per step the :class:`FTAllReduce` (call its ``should_commit()`` in place of
        the manager's before ``optimizer.step()``); with local steps the
        :class:`FTLocalSteps`.
    Raises:
        TypeError: no ``fully_shard``-ed unit with parameters.
        ValueError: a 2-D (HSDP) mesh, parameter groups FSDP2 cannot hook, or local
            steps without the optimizer.
        NotImplementedError: as :class:`FTAllReduce`.
    """
    from . import fsdp2

    mods = [m for _, m, _ in fsdp2._param_groups(model)]
    if cfg.outer_every:
        if optimizer is None:
            raise ValueError("tagc.ft.register: local steps (outer_every) need the inner "
                             "optimizer (optimizer=...)")
        return FTLocalSteps(mods, cfg, manager, pg, optimizer)
    ft = FTAllReduce(manager, pg, cfg)
    for i, m in enumerate(mods):
        m.set_all_reduce_hook(_UnitHook(ft, i))
    return ft


__all__: List[str] = ["FTAllReduce", "FTLocalSteps", "FTManager", "OuterUnit", "PGComm",
                      "QuorumSource", "build_reducer", "carry_feedback", "register"]
