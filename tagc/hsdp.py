"""Custom HSDP: FSDP2 shards inside a node, TAGC compresses the all-reduce between nodes.

``tagc.shard_model(model, cfg, mesh=init_device_mesh(dev, (replicas, shards),
mesh_dim_names=("replicate", "shard")))`` shards every unit over the "shard" dimension
only (a 1-D mesh per node: its plain reduce-scatter and all-gathers stay on the fast
links), and ``register(model, cfg, mesh=mesh)`` gives each unit an all-reduce hook
(``FSDPModule.set_all_reduce_hook``): FSDP calls it with the unit's reduce-scatter
output, this rank's shard summed over its node, and the hook sums it over the replicas
(the nodes) in place, compressed, then divides it by replicas x shards (SUM reductions
forced, FSDP dividing by nothing: :func:`install`), which is native HSDP's average.

The all-reduce is FULL_SHARD's reducer and transports (tagc/reducer.py,
tagc/transports.py) over the replicate group, in one of two forms (docs/DESIGN.md):

* **two-phase** (:class:`TwoPhaseReducer`): the shard, padded to R chunks, goes
  through the mode's to-the-owner transport (chunk j, coded with this replica's
  feedback, to replica j), then each owner codes its chunk of the sum with a feedback
  state of its own (``residual_out``: two-sided error feedback, DoubleSqueeze, arXiv
  1905.05957; with EF21 ``estimate_out``), on the owner's code (``hsdp_out_format``:
  int4 after ternary/sign), and one all-gather brings every owner's code to every
  replica, where all decode it alike (``transports.SPREADS``).  Bytes per rank about
  (R-1)/R times the two codes of one shard: flat in R.  ``exact``/``paper`` send the owners' sums losslessly
  (a sum of R kept sets has at most R*k non-zeros).
* **all-gather** (:class:`GatherReducer`): every replica's whole shard, coded with its
  feedback, to every replica, each summing the R decoded messages in replica order.
  (R-1) coded shards per rank: at R = 2 the same bytes as two-phase with one coding
  fewer per contribution; it grows with R.  ``dense`` in this form is one SUM
  all-reduce, bit for bit native HSDP.

:func:`allreduce_form` picks the form from (``hsdp_allreduce``, R, mode, the shard's
size), the same on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import fsdp2, memory, transports
from .comm import Comm
from .config import TAGCConfig
from .device import CodecStreams, Exec, poison_nonfinite
from .fsdp2 import deferrable
from .overlap import Overlap
from .reducer import UnitReducer, send_owed
from .selection import UnitSpec

HSDP_DIMS = ("replicate", "shard")


def allreduce_form(cfg: TAGCConfig, replicas: int, compressed: bool,
                   shard_numel: int) -> str:
    """The all-reduce form of one unit: ``"two_phase"`` or ``"gather"``.

    ``auto``: uncompressed units and ``dense`` take the all-gather form (one plain
    all-reduce); ``exact``/``paper`` are two-phase (their union needs the owner);
    ``quant`` is two-phase where it sends fewer bytes than the all-gather form,
    counted on this shard's codes: (R-1) codes of a chunk and (R-1) of the owner's
    code (``cfg.out_format()``) against (R-1) codes of the shard.  With one code
    both ways that is from 3 replicas on; ``ternary`` with its owners on ``int4``
    (``hsdp_out_format`` auto) from 4.  At equal bytes the all-gather form wins:
    it codes each contribution once instead of twice.  ``sparse``/``auto``:
    two-phase from 3 replicas on.

    Args:
        cfg: the config.
        replicas: R, the size of the replicate group.
        compressed: whether the unit is compressed.
        shard_numel: the unit's shard, this rank's all-reduce input (quant's choice;
            the same on every replica: FSDP2 pads every rank's shard alike).
    Returns:
        the form.
    Raises:
        NotImplementedError: ``hsdp_allreduce="gather"`` with ``exact``/``paper``.
    """
    if not compressed:
        return "gather"
    form = cfg.hsdp_allreduce
    if form == "auto":
        if not cfg.compresses or replicas <= 2:
            return "two_phase" if cfg.sketched else "gather"
        if cfg.quantizes:
            from .codec import quant_bytes as size, require_codec

            require_codec()
            chunk = math.ceil(shard_numel / replicas)
            two = size(chunk, cfg.quant_format, cfg.quant_block) \
                + size(chunk, cfg.out_format(), cfg.quant_block)
            return "two_phase" if two < size(shard_numel, cfg.quant_format,
                                              cfg.quant_block) else "gather"
        return "two_phase"
    if form == "gather" and cfg.sketched:
        raise NotImplementedError(f"hsdp_allreduce='gather': mode {cfg.mode!r} has no "
                                  "all-gather form; use 'two_phase' or 'auto'")
    return form


def check_mesh(mesh: Any) -> None:
    """Refuse a mesh that is not the (replicate, shard) HSDP layout, clearly."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or names != HSDP_DIMS:
        raise ValueError(
            f"shard_model: an HSDP mesh must be 2-D with mesh_dim_names {HSDP_DIMS} "
            f"(init_device_mesh(device, (replicas, shards), mesh_dim_names={HSDP_DIMS})), "
            f"got {mesh.ndim}-D with names {names or None}; a 1-D mesh is plain FSDP")


def check_units_mesh(mesh: Any, unit_mesh: Any, units: List[UnitReducer]) -> None:
    """Refuse, before any hook is installed, a mesh that does not match how the FSDP2
    units are sharded.  Every rank sees the same model and mesh, so all raise alike.

    Args:
        mesh: ``register``'s mesh (None: plain FSDP2).
        unit_mesh: the 1-D mesh the units are sharded over.
        units: the FSDP2 glue's reducers.
    Raises:
        ValueError: units sharded over the "shard" dimension of a larger mesh (what
            ``shard_model(..., mesh=)`` does) registered without that mesh: nothing
            would sum over the replicas, which would silently drift apart; a mesh
            that is not the HSDP layout, or whose "shard" dimension is not the
            units' group.
    """
    names = tuple(getattr(unit_mesh, "mesh_dim_names", None) or ())
    if mesh is None:
        if names == ("shard",) and units and units[0].world != dist.get_world_size():
            raise ValueError(
                f"register: the model is sharded over the 'shard' dimension of an HSDP "
                f"mesh ({units[0].world} of {dist.get_world_size()} ranks): pass that "
                "mesh, tagc.register(model, cfg, mesh=mesh), or nothing would sum the "
                "gradients over the replicas")
        return
    check_mesh(mesh)
    want = dist.get_process_group_ranks(mesh.get_group("shard"))
    if names != ("shard",) or dist.get_process_group_ranks(unit_mesh.get_group()) != want:
        raise ValueError("register: the model is not sharded over this mesh's 'shard' "
                         "dimension; shard it with tagc.shard_model(model, cfg, mesh=mesh) "
                         "and pass the same mesh")


class ReplicaReducer(UnitReducer):
    """One unit's cross-replica all-reduce: a :class:`UnitReducer` over the
    replicate group that FSDP calls through :meth:`hook`.

    Args:
        cfg, spec, group, rank, world, streams: as :class:`UnitReducer` (``world`` is
            R, ``spec.flat_numel`` the reducer's input length).
        shard_numel: L, this rank's shard (the hook's tensor).
    """

    def __init__(self, cfg: TAGCConfig, spec: UnitSpec, group: Any, rank: int, world: int,
                 streams: CodecStreams, shard_numel: int) -> None:
        super().__init__(cfg, spec, group, rank, world, 1.0, 1.0, streams)
        self.shard_numel = shard_numel
        # replicas x shards, set by install(): the hook averages, FSDP does not
        self.divide = 1.0
        # local steps (tagc/local.py): the round's starting shard, the outer momentum
        # and the round's inner step count, this rank's own
        self.local = False
        self.outer_start: Optional[torch.Tensor] = None
        self.outer_momentum: Optional[torch.Tensor] = None
        self.outer_inner: Optional[torch.Tensor] = None
        self.outer_avg: Optional[torch.Tensor] = None  # a streamed sync's, in flight
        self.grid: List[List[int]] = []  # the mesh's global ranks, set by reducers()

    def outer_buffers(self) -> List[Any]:
        if not self.local:
            return []
        return memory.outer_buffers(self.cfg, self.shard_numel)

    def hook(self, t: torch.Tensor) -> None:
        """FSDP's all-reduce hook: ``t`` (this rank's shard, summed over its node) is
        replaced by its sum over the replicas, divided by :attr:`divide`."""
        if not t.is_cuda:
            self._average(t)
            return
        with self.streams.around(t):
            self._average(t)

    def _average(self, t: torch.Tensor) -> None:
        self._all_reduce(t)
        if self.divide != 1.0:
            t.div_(self.divide)

    def _all_reduce(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def row_group(self) -> Any:
        # the shards of a node share a replicate rank: checkpoint rows per global rank
        return dist.group.WORLD

    def default_wire_bytes(self, inp: torch.Tensor) -> float:
        # native HSDP's ring all-reduce of the shard
        return 2.0 * (self.world - 1) / self.world * self.shard_numel * inp.element_size()

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            raise TypeError(f"TAGC: unit {self.name!r} has a non-floating gradient ({t.dtype})")
        flat = t.reshape(-1)
        if flat.numel() != self.shard_numel:
            raise RuntimeError(f"TAGC: unit {self.name!r}: all-reduce input of {flat.numel()} "
                               f"elements, expected {self.shard_numel} (every parameter of a "
                               "compressed unit must get a gradient each step)")
        return flat if flat.is_contiguous() else flat.contiguous()


class GatherReducer(ReplicaReducer):
    """The all-gather form: the reducer's input and output are the whole shard."""

    FORM = "gather"

    def _all_reduce(self, t: torch.Tensor) -> None:
        flat = self._flat(t)
        out = self.streams.scratch.empty("out", flat.shape, flat.dtype, flat.device)
        self._reduce(flat, out)
        t.copy_(out.view_as(t))

    def shards_in(self, inp: torch.Tensor) -> int:
        return 1  # an all-reduce input: this rank's one shard, all of it summed

    @property
    def estimate_numel(self) -> int:
        return self.flat_numel  # every replica's estimate of the whole sum

    def transport(self, call: transports.Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
        acc.zero_()
        transports.SPREADS[self.cfg.mode](call, inp, acc, False)

    def plain_sum(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)
        comm.all_reduce(out)


class TwoPhaseReducer(ReplicaReducer):
    """The two-phase form: the reducer's input is the shard padded to R chunks of S
    (``spec.flat_numel`` = R*S), its output this replica's chunk of the sum, and
    :meth:`after` brings every owner's chunk to every replica.

    The to-everyone phase's feedback (lossy codes with ``error_feedback``):

    * residual feedback: ``residual_out`` (S), what the owner's code of its chunk of
      the sum left, sent with the next call (DoubleSqueeze);
    * EF21: ``estimate_out`` (R*S, the same on every replica), every owner's estimate
      as all replicas hold it; an owner codes only the change of its estimate against
      it and everyone adds the decoded change (EF21 on the way out, as EF21-P /
      bidirectional EF21).  The estimate moves slowly, so the code's error is a
      fraction of that change, not of the estimate: a residual on the estimate
      itself measured +1.8% at R = 4 after 300 steps (docs/RESULTS.md).
    """

    FORM = "two-phase"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.chunk = self.flat_numel // self.world
        self.residual_out: Optional[torch.Tensor] = None
        self.estimate_out: Optional[torch.Tensor] = None
        self.full: Optional[torch.Tensor] = None

    @property
    def out_state(self) -> Optional[str]:
        """The to-everyone phase's state attribute, None without one (lossless
        codes, no feedback, ``dense``)."""
        if not self.keeps_feedback or self.cfg.sketched:  # exact/paper: lossless codes
            return None
        return "estimate_out" if self.cfg.ef21 else "residual_out"

    def feedback_buffers(self) -> List[Any]:
        out = super().feedback_buffers()
        if self.keeps_feedback:
            out += memory.out_buffers(self.cfg, self.chunk, self.world)
        return out

    def coded_residuals(self) -> Dict[str, int]:
        out = super().coded_residuals()
        if out and self.out_state == "residual_out":
            out["residual_out"] = self.chunk
        return out

    def _all_reduce(self, t: torch.Tensor) -> None:
        flat = self._flat(t)
        scratch = self.streams.scratch
        inp = flat
        if self.flat_numel != flat.numel():  # padded to R chunks
            inp = scratch.empty("padded", (self.flat_numel,), flat.dtype, flat.device)
            inp[:flat.numel()].copy_(flat)
            inp[flat.numel():].zero_()
        out = scratch.empty("out", (self.chunk,), flat.dtype, flat.device)
        self.full = None
        self._reduce(inp, out)
        if self.full is not None:
            t.copy_(self.full.view(-1)[:flat.numel()].view_as(t))

    def after(self, comm: Comm, dev: Exec, out: torch.Tensor, step: int) -> None:
        """The to-everyone phase: this replica's chunk of the sum to every replica,
        coded when the to-the-owner phase was (else sent plainly, settling the
        state after a settling call), decoded alike everywhere."""
        if out.numel() == 0:
            return
        if self.last_path == "compress":
            self._coded(comm, dev, out, step)
            return
        send = out
        if self.last_path == "settle" and self.residual_out is not None:
            send = send_owed(dev, out, self.residual_out)
        self.full = torch.empty(self.world, out.numel(), dtype=out.dtype, device=out.device)
        comm.all_gather(self.full, send)
        if self.last_path == "settle" and self.estimate_out is not None:
            self.estimate_out.copy_(self.full.reshape(-1))  # every estimate exact again

    def _coded(self, comm: Comm, dev: Exec, out: torch.Tensor, step: int) -> None:
        """The coded to-everyone phase, with the state :attr:`out_state` names."""
        shape = (self.world, out.numel())
        # EF21 on the CPU: the spreads add every decoded change into their output,
        # so they add straight into the held estimates (no zeroed copy, no sum, no
        # copy back: three passes over R chunks); a CUDA call decodes apart, since
        # a poisoned call must keep the old estimates (dev.keep)
        in_place = self.out_state == "estimate_out" and dev.ok is None
        x, res = out, None
        if self.out_state == "residual_out":
            if self.residual_out is None:
                self.residual_out = torch.zeros(out.numel(), dtype=self.cfg.residual_dtype,
                                                device=out.device)
            res = self.residual_out
        elif self.out_state == "estimate_out":
            if self.estimate_out is None:
                self.estimate_out = torch.zeros(self.flat_numel, dtype=torch.float32,
                                                device=out.device)
            held = self.estimate_out.view(shape)
            if self.damp is not None:  # the to-the-owner estimates were damped alike
                held.mul_(self.damp)
            x = out.float() - held[self.rank]
        full = held if in_place else dev.empty("full", shape, torch.float32,
                                               out.device).zero_()
        if dev.ok is not None and self.cfg.compresses:
            # CUDA: a poisoned call leaves the state alone and sends NaN on
            poison_nonfinite(x.view(1, -1), ~dev.ok)
        call = transports.Call(self.cfg, self.index, step, res, comm, dev, self.stats,
                               self._warn_unpeeled)
        transports.SPREADS[self.cfg.mode](call, x, full, True)
        if self.out_state == "estimate_out" and not in_place:
            held = self.estimate_out.view(shape)
            held.copy_(dev.keep(held + full, held))
            full = held
        self.full = full


def reducers(model: Any, cfg: TAGCConfig, mesh: Any, streams: CodecStreams,
             base: List[UnitReducer]) -> List[ReplicaReducer]:
    """One replica reducer per unit of the FSDP2 glue's reducers (same identity), of
    the form :func:`allreduce_form` picks.

    Args:
        model: the sharded model.
        cfg: the config.
        mesh: the (replicate, shard) mesh.
        streams: the codec streams.
        base: the FSDP2 glue's reducers (their spec; their group is the shard group).
    Returns:
        the reducers, in ``base``'s order.
    """
    group = mesh.get_group("replicate")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: List[ReplicaReducer] = []
    for u in base:
        shard = u.flat_numel // u.world  # the reduce-scatter output: the hook's input
        if allreduce_form(cfg, world, u.compressed, shard) == "gather":
            spec = dataclasses.replace(u.spec, flat_numel=shard)
            out.append(GatherReducer(cfg, spec, group, rank, world, streams, shard))
        else:
            spec = dataclasses.replace(u.spec, flat_numel=world * math.ceil(shard / world))
            out.append(TwoPhaseReducer(cfg, spec, group, rank, world, streams, shard))
        out[-1].layout = u.layout
        # global rank of (replica, shard): checkpoint rows are per global rank
        out[-1].grid = mesh.mesh.tolist()
    return out


class Hook:
    """One unit's all-reduce hook: overlapped with the backward where FSDP allows it
    (tagc/overlap.py), else run in place after every overlapped unit before it.

    Args:
        reducer: the unit's replica reducer.
        params: the unit's ``FSDPParam``s (what :func:`~tagc.fsdp2.deferrable` checks).
        overlap: the model's worker, None to always block (``hsdp_overlap`` off).
    """

    def __init__(self, reducer: ReplicaReducer, params: List[Any],
                 overlap: Optional[Overlap]) -> None:
        self.reducer, self.params, self.overlap = reducer, params, overlap

    def __call__(self, t: torch.Tensor) -> None:
        ov = self.overlap
        if ov is not None and deferrable(t, self.params):
            ov.submit(lambda: self.reducer.hook(t))
            return
        if ov is not None:
            ov.wait()  # the earlier units' collectives first: the peers' order
        self.reducer.hook(t)


def install(mods: List[Any], reducers_: List[ReplicaReducer], shards: int,
            overlap: Optional[Overlap]) -> None:
    """The hook on every unit (:class:`Hook`, overlapped by ``overlap`` unless None);
    SUM reductions, and the hook's one divide by replicas x shards after its sum
    (native HSDP's SUM-then-divide), FSDP dividing by nothing.

    FSDP's own factor would not do: with one rank per node (``shards`` 1) FSDP2's
    ``foreach_reduce`` skips the reduce-scatter and copies its input divided by the
    factor, then divides by it again after the hook (torch 2.13), so R would apply
    twice (gradients R times too small: under ``grad_clip`` a different run, not a
    scaled one).  So FSDP sums and divides by nothing (:func:`fsdp2.sum_reductions`,
    as for FULL_SHARD).
    """
    for m, r in zip(mods, reducers_):
        m.set_all_reduce_hook(Hook(r, fsdp2.unit_params(m), overlap))
        fsdp2.sum_reductions(m, shards)
        r.divide = float(r.world * shards)

