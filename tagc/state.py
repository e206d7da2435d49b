"""The public face: :func:`register` and the :class:`TAGCState` it returns."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import (checkpoint, codec, fsdp1, fsdp2, gather, hsdp, local, memory, overlap, stats,
               teardown)
from .config import TAGCConfig
from .device import CodecStreams
from .reducer import UnitReducer

logger = logging.getLogger("tagc_hook")


class TAGCState:
    """What :func:`register` returns: stats, checkpoints and the loss-scale hook.

    Not constructed directly.  ``units`` lists the per-unit reducers (FQN order).
    """

    def __init__(self, cfg: TAGCConfig, kind: str, units: List[UnitReducer], rank: int,
                 world_size: int, streams: CodecStreams,
                 modules: Optional[List[nn.Module]] = None,
                 overlap_: Optional[overlap.Overlap] = None) -> None:
        self.cfg, self.kind, self.units = cfg, kind, units
        self.rank, self.world_size = rank, world_size
        self._streams = streams
        self._overlap = overlap_  # CPU: the exchanges still in flight (tagc/overlap.py)
        self._meshes = checkpoint.RowMeshes()
        self._modules = modules or []
        self._switch = gather.GatherSwitch()
        self.gathers: List[gather.GatherComm] = []
        # local steps' outer loop (outer_every; tagc/local.py), else None
        self.local: Optional[local.LocalSteps] = None

    def exact_gathers(self) -> ContextManager[None]:
        """Context manager: FSDP's parameter all-gathers are exact inside it.

        With ``cfg.gather`` set, the forward and backward see the block-quantized
        view of the weights; validate inside this block so the loss reported is the
        model's (the sharded masters, what checkpoints hold), not its quantized
        view.  Every FSDP2 module is resharded on entry and exit so that no unit
        keeps weights gathered under the other setting.  Call it on every rank (the
        gathers are collectives).  A no-op without ``cfg.gather``.
        """
        if not self.gathers:
            return contextlib.nullcontext()
        return self._switch.exact_gathers(self._modules)

    def stats(self, global_totals: bool = False) -> Dict[str, Any]:
        """Statistics since registration (or :meth:`reset_stats`), of THIS rank.

        Every counter is what this rank did: the bytes it sent, the entries
        peeling left in the shards it owns, its non-finite fallbacks.  Ranks
        differ (each owns other shards); ``global_totals=True`` adds the sums
        over the ranks of the unit's process group (custom HSDP: every rank), at
        the cost of one small all-reduce (call it on every rank).

        Args:
            global_totals: also return ``global_total`` and
                ``global_compressed_total``: the counters of ``total`` and
                ``compressed_total`` summed over the ranks (per-collective
                details and ``density``/``wire_ratio`` recomputed from the sums).
        Returns:
            ``{"units": {name: {...}}, "total": {...}, "compressed_total": {...}}``.
            Per entry: ``calls``, ``compressed_calls`` (of which
            ``bypassed_calls`` took the plain path by the bypass's choice,
            ``bypass_every``, and ``guard_resets`` the plain path that settles
            the feedback state by the feedback guard's, ``guard_ratio``),
            ``plain_calls`` (plain
            reduce-scatter), ``dense_step_calls`` (those of them in the
            warm-up's ``dense_steps``), ``nonfinite_fallbacks``, ``collectives``
            (per torch.distributed function: calls and bytes of the tensors
            handed to it, i.e. the send buffer), ``bytes_handed`` (their sum),
            ``wire_bytes`` (bytes this rank sends on an ideal network: all-to-all
            minus its own chunk, isend all of it (``irecv`` entries list the
            receive buffers and add nothing to the byte totals), ring
            all-reduce ``2(N-1)/N``, reduce: all unless it is the destination,
            reduce-scatter ``(N-1)/N``), ``default_wire_bytes`` (what FSDP's
            ideal ring reduce-scatter would send for the same calls: ``(N-1)/N
            * padded numel * element size``; custom HSDP: native HSDP's ring
            all-reduce over the replicas, ``2(R-1)/R * shard bytes``; there
            the counters are the cross-replica traffic only, the reduce-scatter
            inside the node is FSDP's and not counted), ``wire_ratio``, ``control_bytes``
            (non-finite agreement, unpeeled counts), ``unpeeled`` (entries
            peeling left; estimated in paper mode, recovered exactly in exact
            mode), ``recovered``, ``density`` (mean union size / shard size at
            the owner; 1 in quant mode), ``collision_dropped`` and
            ``collision_dropped_l1`` (paper lanes: kept entries that the SUM
            carries erased from the union, counted by their senders, and the
            L1 mass lost with them), ``coded_ef`` / ``coded_bitmap`` /
            ``coded_dense`` (auto mode: shard messages in each coding);
            parameter all-gathers (``cfg.gather``, FSDP2), apart from every
            gradient counter above: ``gather_calls`` (of which
            ``gather_quantized_calls`` and ``gather_exact_calls``, the latter
            counting ``gather_nonfinite`` NaN/Inf fallbacks, the post-forward
            re-gathers of ``reshard_after_forward=int`` and ``gather_delta``'s
            first call of each unit; ``gather_unchanged_calls``: quantized calls
            of ``gather_delta`` in a backward where no rank's shard had changed,
            which sent the flag bytes only), ``gather_wire_bytes``
            (ring all-gather: (N-1) x the message this rank sends, plus (N-1)
            flag bytes for each ``gather_delta`` call in a backward),
            ``gather_default_wire_bytes`` (FSDP's exact gather of the same calls),
            ``gather_wire_ratio``; gathers inside :meth:`exact_gathers` (validation)
            are not counted.  On CUDA the data-dependent counters are
            accumulated on the device and read here (the only host syncs); a
            non-finite call counts in ``nonfinite_fallbacks`` only, and exact
            mode's ``unpeeled`` entries are estimated, not recovered
            (``recovered`` stays 0).  ``memory``: :meth:`memory`.
        """
        self._join()
        units = {u.name: u.stats_dict() for u in self.units}
        out = {"units": units,
               "total": stats.total(list(units.values())),
               "compressed_total": stats.total([s for s in units.values() if s["compressed"]]),
               "memory": self.memory()}
        if global_totals:
            out.update(self._global(out["total"], out["compressed_total"]))
        return out

    def memory(self) -> Dict[str, Any]:
        """What TAGC's feedback state holds on this rank, across steps.

        Returns:
            ``feedback_bytes`` (the buffers allocated now), ``feedback_bytes_steady``
            (once every compressed unit has made a compressed call:
            :func:`tagc.memory.unit_buffers` of each), ``params`` (the units'
            parameters, every parameter FSDP manages) and
            ``feedback_bytes_per_param`` (steady / params; the preset's memory
            cost per parameter of the model, docs/USAGE.md); ``outer_bytes``, local
            steps' outer state (``outer_every``: two fp32 shards per unit);
            ``gather_held_bytes``, what ``gather_delta`` keeps between calls (each
            unit's gathered weights and this rank's shard as last coded).
        """
        held = steady = params = outer = 0
        for u in self.units:
            params += u.numel
            bufs = u.feedback_buffers()
            steady += memory.buffer_bytes(bufs)
            outer += memory.buffer_bytes(u.outer_buffers())
            for name, _, _ in bufs:
                t = getattr(u, name)
                if t is not None:
                    held += t.numel() * t.element_size()
        return {"feedback_bytes": held, "feedback_bytes_steady": steady, "params": params,
                "feedback_bytes_per_param": steady / params if params else 0.0,
                "outer_bytes": outer,
                "gather_held_bytes": sum(g.held_bytes() for g in self.gathers)}

    def summary(self, name: Optional[str] = None) -> str:
        """One line of :meth:`stats` for a log: units compressed, bytes, feedback state.

        Args:
            name: what to call the config (the preset's name); default its mode.
        Returns:
            e.g. ``"TAGC tagc-balanced: 12/14 units compressed (97% of params), sent
            4.7 MB of 33.6 MB (85.9% saved), feedback 0.56 B/param"``: this rank's
            gradient bytes against FSDP's plain reduce-scatter of the same calls, and
            with ``cfg.gather`` the parameter all-gathers' bytes likewise.
        """
        st = self.stats()
        units = list(st["units"].values())
        comp = [u for u in units if u["compressed"]]
        params = sum(u["numel"] for u in units)
        share = 100 * sum(u["numel"] for u in comp) / params if params else 0.0
        tot = st["total"]

        def sent(what: str, key: str) -> str:
            done, plain = tot[key], tot[key.replace("wire", "default_wire")]
            if not plain:  # no call yet: a percentage of nothing would read as a result
                return f"{what} nothing yet"
            return (f"{what} {done / 1e6:.1f} MB of {plain / 1e6:.1f} MB "
                    f"({100 * (1 - done / plain):.1f}% saved)")

        parts = [f"{len(comp)}/{len(units)} units compressed ({share:.0f}% of params)",
                 sent("sent", "wire_bytes")]
        if self.cfg.gather != "none":
            parts.append(sent("gathers", "gather_wire_bytes"))
        parts.append(f"feedback {st['memory']['feedback_bytes_per_param']:.2f} B/param")
        return f"TAGC {name or self.cfg.mode}: " + ", ".join(parts)

    def _global(self, tot: Dict[str, Any], comp: Dict[str, Any]) -> Dict[str, Any]:
        """The counters of both totals summed over the ranks (one all-reduce)."""
        group = self.units[0].row_group if self.units else None
        dev = self.units[0].device if self.units and self.units[0].device.type == "cuda" \
            else torch.device("cpu")
        vec = torch.tensor([float(d[c]) for d in (tot, comp) for c in stats.COUNTERS],
                           dtype=torch.float64, device=dev)
        dist.all_reduce(vec, group=group)  # SUM: gloo's AVG is not trusted
        vals = vec.tolist()
        res = {}
        for i, key in enumerate(("global_total", "global_compressed_total")):
            d: Dict[str, Any] = {c: vals[i * len(stats.COUNTERS) + j]
                                 for j, c in enumerate(stats.COUNTERS)}
            for c in d:
                if c != "collision_dropped_l1" and c != "wire_bytes" and \
                        c != "default_wire_bytes":
                    d[c] = int(round(d[c]))
            d["collectives"] = {}
            d["ranks"] = self.world_size
            stats.derive(d)
            res[key] = d
        return res

    def _join(self) -> None:
        """Wait for every unit's work still in flight: the codec streams (CUDA) and
        the overlapped HSDP all-reduces (CPU; a backward already waits for its own)."""
        self._streams.join()
        if self._overlap is not None:
            self._overlap.wait()

    def reset_stats(self) -> None:
        """Zero every counter (feedback state and step counters are kept)."""
        self._join()
        for u in self.units:
            u.stats.reset()

    def scale_residuals(self, factor: float) -> None:
        """Multiply every residual (and EF21 estimate) by ``factor``.

        Feedback state holds gradient in the loss scale of the step that
        produced it; with dynamic loss scaling call this after
        ``scaler.update()`` with ``new_scale / old_scale`` so it stays in the
        new scale.

        Args:
            factor: finite positive multiplier.
        """
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"scale_residuals: factor must be finite and > 0, got {factor!r}")
        self._join()
        if factor == 1.0:
            return
        for u in self.units:
            u.scale_feedback(factor)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's TAGC state: feedback state per unit, step counters, seeds, config.

        Works both ways PyTorch checkpoints are written:

        * ``torch.save(state.state_dict(), f"tagc-rank{r}.pt")`` per rank, and
          ``state.load_state_dict(torch.load(...))`` on the same rank later;
        * ``torch.distributed.checkpoint``: ``dcp.save({"tagc": state}, ...)``
          and ``dcp.load({"tagc": state}, ...)`` (``TAGCState`` is a DCP
          ``Stateful``), beside the model and optimizer.

        Feedback state is a row-sharded ``DTensor`` per unit (``tagc/checkpoint.py``
        says why).

        Returns:
            a dict of plain data and DTensors over CPU copies (``to_local()``
            gives this rank's ``(1, length)`` row).
        """
        self._join()
        if self.local is not None:
            self.local.prepare_checkpoint()  # a streamed sync's average, not its thread
        return checkpoint.state_dict(self.units, self.cfg, self.kind, self.world_size,
                                     self.rank, self._meshes)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank of the same setup.

        Args:
            sd: the dict, from ``torch.load`` of this rank's file or filled in
                by ``torch.distributed.checkpoint``.
        Raises:
            ValueError: format, config, world size, rank, unit layout or a
                state's size differ; nothing is changed then.
        """
        rows = checkpoint.validate(sd, self.units, self.cfg, self.world_size, self.rank,
                                   self.kind)
        self._join()  # the old state may still be in use on a codec stream or the worker
        checkpoint.restore(sd, self.units, rows)
        self._restart_gathers()

    def _restart_gathers(self) -> None:
        # a load comes with the model's weights: gather_delta's reconstruction of the
        # old ones would take the jump as one step's change
        for g in self.gathers:
            g.reset()

    def check_dcp(self, checkpoint_id: Any, key: str = "tagc") -> bool:
        """Check a ``torch.distributed.checkpoint`` checkpoint's TAGC state against this
        run before anything is loaded (a training script calls it before it loads the
        model and optimizer, so that a wrong resume changes nothing).

        Args:
            checkpoint_id: the checkpoint folder.
            key: the key the state was saved under (``dcp.save({key: state, ...})``).
        Returns:
            True when it loads as it is, False when :meth:`load_dcp` maps it onto
            this run's shape (another FSDP version, world size or replica count).
        Raises:
            ValueError: no TAGC state there, another TAGC config (the knobs named), or
                a shape it cannot be mapped from (what, and what to do).
        """
        saved, _ = checkpoint.read_saved(checkpoint_id, key)
        return checkpoint.check_saved(saved, self.units, self.cfg, self.kind,
                                      self.world_size)

    def load_dcp(self, checkpoint_id: Any, key: str = "tagc") -> None:
        """Restore the TAGC state of a ``torch.distributed.checkpoint`` checkpoint, on
        this run's shape whatever the shape it was written on.

        On the same shape the rows load bit for bit (as ``dcp.load({key: state})``).
        On another FSDP version, world size or replica count every rank reads every
        saved row and maps it by parameter name (tagc/checkpoint.py: residuals keep
        what they owe the averaged gradient, each new rank starting from the weighted
        mean of the old ranks' rows); call it on every rank.

        Args:
            checkpoint_id: the checkpoint folder.
            key: the key the state was saved under.
        Raises:
            ValueError: as :meth:`check_dcp`; nothing is changed then.
        """
        import torch.distributed.checkpoint as dcp

        saved, sizes = checkpoint.read_saved(checkpoint_id, key)
        if checkpoint.check_saved(saved, self.units, self.cfg, self.kind, self.world_size):
            sd = self.state_dict()
            if saved["layout"] is None:
                del sd["layout"]  # a v2 checkpoint has none: DCP would miss the key
            # knobs added since it was written: not in it (DCP would miss them), and
            # compared by what the saved knobs resolve them to (checkpoint._saved_config)
            sd["config"] = {k: v for k, v in sd["config"].items() if k in saved["config"]}
            dcp.load({key: sd}, checkpoint_id=str(checkpoint_id))
            self.load_state_dict(sd)
            return
        template: Dict[str, Any] = {}
        for u in self.units:
            for name, _, dtype in u.state_buffers():
                if saved["units"][u.name].get(f"has_{name}"):
                    size = sizes[f"units.{u.name}.{name}"]
                    template[f"{key}.units.{u.name}.{name}"] = torch.empty(tuple(size),
                                                                          dtype=dtype)
        checkpoint.load_alone(template, checkpoint_id)
        old = {(u.name, name): template[f"{key}.units.{u.name}.{name}"]
               for u in self.units for name, _, _ in u.state_buffers()
               if f"{key}.units.{u.name}.{name}" in template}
        rows = checkpoint.remap(saved, old, self.units, self.cfg, self.kind,
                                self.world_size, self.rank)
        self._join()
        checkpoint.restore(saved, self.units, rows)
        self._restart_gathers()
        logger.info("TAGC: feedback state mapped from %s on %d ranks to %s on %d ranks",
                    saved["kind"], saved["world_size"], self.kind, self.world_size)


def _check_agreement(cfg: TAGCConfig, units: List[UnitReducer], world: int,
                     group: Any) -> None:
    """Every rank must hold the same config and unit layout; raise on all ranks if not."""
    mine = {"config": cfg.to_dict(), "world_size": world,
            "units": [(u.name, u.numel, u.flat_numel, u.compressed) for u in units]}
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    bad = [r for r, g in enumerate(gathered) if g != gathered[0]]
    if bad:
        diff = []
        for r in bad:
            g = gathered[r]
            keys = [k for k in g["config"] if g["config"].get(k) != gathered[0]["config"].get(k)]
            diff.append(f"rank {r}: config fields {keys}"
                        + ("" if g["units"] == gathered[0]["units"] else ", unit layout"))
        raise ValueError("register: TAGC config or FSDP unit layout differs between ranks "
                         f"(compared with rank 0): {'; '.join(diff)}")


def _log_units(state: TAGCState) -> None:
    """Rank 0 only (every rank has the same units: :func:`_check_agreement`): one
    INFO line for the model, one DEBUG line per unit (:func:`_unit_line`), and a
    WARNING when fewer than half of the parameters are compressed."""
    if dist.get_rank() != 0:
        return
    units, cfg = state.units, state.cfg
    for u in units:
        logger.debug("TAGC unit %r: %s", u.name, _unit_line(u, cfg))
    total = sum(u.numel for u in units)
    comp = sum(u.numel for u in units if u.compressed) if cfg.compresses else 0
    logger.info("TAGC registered (%s, mode=%s): %d units, %d compressed, %.1f%% of the "
                "parameters", state.kind, cfg.mode, len(units),
                sum(u.compressed for u in units) if cfg.compresses else 0,
                100.0 * comp / max(total, 1))
    if 2 * comp < total:
        logger.warning("TAGC compresses %.1f%% of the parameters (%d of %d elements): %s",
                       100.0 * comp / max(total, 1), comp, total, _why_little(units, cfg))


def _unit_line(u: UnitReducer, cfg: TAGCConfig) -> str:
    """What happens to one unit's gradient, in a user's terms.  A unit goes whole
    (FSDP hands the hook one flat buffer), compressed when selected parameters hold
    at least half of it."""
    if u.selected_numel == 0:
        return f"not compressed (none of its {u.numel} elements is a selected parameter)"
    sel = f"{u.selected_numel} of its {u.numel} elements are selected parameters"
    if not cfg.compresses:
        return f"not compressed (mode 'dense'; {sel})"
    if not u.compressed:
        return f"not compressed (only {sel}, fewer than half)"
    if u.selected_numel == u.numel:
        return f"compressed (all {u.numel} of its elements are selected parameters)"
    return f"compressed ({sel}; the rest ride along)"


def _why_little(units: List[UnitReducer], cfg: TAGCConfig) -> str:
    """Why fewer than half of the parameters are compressed, in a user's terms."""
    if not cfg.compresses:
        return "mode 'dense' sends every gradient uncompressed (it is the baseline)"
    selected = sum(u.selected_numel for u in units)
    if selected == 0:
        return (f"no parameter matched layers={cfg.layers!r} (built-in policies select "
                f"the weights of nn.Linear, nn.Embedding and Hugging Face Conv1D layers "
                f"with >= min_numel={cfg.min_numel} elements, attention QKV projections "
                f"excluded); lower min_numel, use layers='all' or pass a callable")
    mixed = [u for u in units if not u.compressed and u.selected_numel]
    if mixed:
        names = ", ".join(f"{u.name} ({100 * u.selected_numel // max(u.numel, 1)}% selected)"
                          for u in mixed[:3])
        return (f"{sum(u.selected_numel for u in mixed)} selected elements share FSDP units "
                f"with unselected ones, and a unit is compressed only when selected "
                f"parameters hold half of it: {names}{', ...' if len(mixed) > 3 else ''}; "
                f"wrap the model with tagc.fsdp1_auto_wrap_policy(model, cfg) (FSDP1) or "
                f"tagc.shard_model(model, cfg) (FSDP2)")
    return (f"the selected parameters are only {100 * selected // max(sum(u.numel for u in units), 1)}% "
            f"of the model (layers={cfg.layers!r}, min_numel={cfg.min_numel})")


def register(model: nn.Module, cfg: TAGCConfig, mesh: Any = None,
             optimizer: Optional[torch.optim.Optimizer] = None) -> TAGCState:
    """Make an FSDP model's gradient reduce-scatter use TAGC.

    Args:
        model: an FSDP1 root (``FullyShardedDataParallel``) or an FSDP2 model
            (``fully_shard``-ed root or containing ``fully_shard``-ed modules).
            Register before the first backward, once.
        cfg: the config; must be identical on every rank (checked).
        mesh: custom HSDP only: the 2-D ``("replicate", "shard")`` mesh the model was
            sharded with (``shard_model(model, cfg, mesh=mesh)``); the hook then
            compresses the all-reduce over "replicate".  None: FSDP1/FSDP2 over one
            group.
        optimizer: local steps only (``cfg.outer_every`` > 0, custom HSDP): the
            user's optimizer, whose every ``outer_every``-th step ends a round with
            the outer step (tagc/local.py).
    Returns:
        the :class:`TAGCState` (stats, checkpoints).  Registering also installs
        :func:`tagc.teardown.install`'s exit drain (once per process), so a program
        that ends right after training does not lose a rank to gloo's exit race.
    Raises:
        TypeError: not an FSDP model, or ``cfg`` not a TAGCConfig.
        ValueError: unsupported sharding strategy, configs differ between ranks, a
            mesh that is not the HSDP layout or not the model's, an HSDP model
            without its mesh; ``outer_every`` without a mesh or an optimizer, or an
            optimizer without ``outer_every``.
        RuntimeError: registered twice.
    """
    if not isinstance(cfg, TAGCConfig):
        raise TypeError(f"register: cfg must be a TAGCConfig, got {type(cfg).__name__}")
    if cfg.compresses:
        codec.require_codec()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("register: torch.distributed is not initialized")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        if cfg.gather != "none":
            raise ValueError(f"register: gather={cfg.gather!r} quantizes FSDP2's parameter "
                             "all-gathers (FSDPModule.set_custom_all_gather); FSDP1 has no such "
                             "hook. Shard the model with FSDP2 (tagc.shard_model or "
                             "fully_shard), or set gather='none'")
        kind, glue = "fsdp1", fsdp1
    else:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            FSDPModule = ()  # type: ignore[assignment]
        if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
            kind, glue = "fsdp2", fsdp2
        elif any(isinstance(m, FSDP) for m in model.modules()):
            raise TypeError("register: pass the root FullyShardedDataParallel module")
        else:
            hint = "" if torch.cuda.is_available() else (
                "; on a machine without a GPU, FSDP1 needs device_id=torch.device('cpu') "
                "(else it fails with 'FSDP needs a non-CPU accelerator device')")
            raise TypeError(f"register: {type(model).__name__} is not an FSDP model (wrap it "
                            "with FullyShardedDataParallel(model, auto_wrap_policy=tagc."
                            "fsdp1_auto_wrap_policy(model, cfg)) or tagc.shard_model(model, "
                            f"cfg) first){hint}")
    if cfg.outer_every and (mesh is None or optimizer is None):
        raise ValueError("register: outer_every (local steps) is for TAGC's custom HSDP: "
                         "register(model, cfg, mesh=mesh, optimizer=optimizer) with the "
                         "model sharded by tagc.shard_model(model, cfg, mesh=mesh)")
    if optimizer is not None and not cfg.outer_every:
        raise ValueError("register: optimizer= is for local steps (outer_every >= 1)")
    if kind == "fsdp2":
        fsdp2.check_torch(hsdp=mesh is not None, gather=cfg.gather != "none")
    streams = CodecStreams()
    units, mods, group = glue.reducers(model, cfg, streams)
    if kind == "fsdp2":
        hsdp.check_units_mesh(mesh, fsdp2.shard_mesh(mods), units)
    elif mesh is not None:
        raise ValueError("register: mesh= is for TAGC's custom HSDP (FSDP2, "
                         "tagc.shard_model(model, cfg, mesh=mesh)); FSDP1 has no HSDP hook")
    if mesh is not None:  # custom HSDP: the hook compresses the all-reduce between nodes
        shards = units[0].world
        units = hsdp.reducers(model, cfg, mesh, streams, units)
        group, kind = None, "fsdp2-hsdp"
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_agreement(cfg, units, world, group)
    ov = overlap.Overlap() if mesh is not None and cfg.hsdp_overlap and \
        not cfg.outer_every else None
    order = None
    if kind == "fsdp2" and cfg.fsdp_overlap and \
            fsdp2.param_groups(mods[0])[0].device.type == "cpu":
        # FSDP2 over one group on the CPU: its exchanges on a worker (tagc/overlap.py)
        ov, order = overlap.Overlap("FSDP2 reduce-scatter"), fsdp2.ForwardOrder(mods)
    outer = None
    if cfg.outer_every:  # no hook: FSDP averages inside the node, the rounds do the rest
        outer = local.LocalSteps(mods, units, mesh.get_group("replicate"), optimizer)
    elif mesh is not None:
        hsdp.install(mods, units, shards, ov)
    elif order is not None:
        fsdp2.install(model, units, mods, ov, order)
    else:
        glue.install(model, units, mods)
    state = TAGCState(cfg, kind, units, rank, world, streams,
                      mods if kind != "fsdp1" else None, ov)
    state.local = outer
    if cfg.gather != "none" or order is not None:
        state.gathers = gather.install(cfg, mods, [u.stats for u in units],
                                       [u.name for u in units], state._switch,
                                       ov if order is not None else None, order)
    _log_units(state)
    # a program that ends right after training must not lose a rank to gloo's exit race
    teardown.install()
    return state
