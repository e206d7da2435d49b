"""TAGC state in checkpoints: ``torch.save`` per rank, or ``torch.distributed.checkpoint``.

Feedback state differs per rank, everything else is identical on every rank.  So each
unit's residual (and EF21 estimate) is a ``DTensor`` of global shape ``(N, length)``
sharded by row over the unit's process group: DCP writes every rank's row and reads each
row back into its rank (a plain tensor under one key would be de-duplicated as if
replicated: one rank's state for all).  ``rank`` is an ``(N,)`` DTensor holding each
rank's own number, so a per-rank file loaded on the wrong rank is refused.  A unit
whose state does not exist yet gets zeros and ``has_<name>=False``: the template DCP
loads into must hold every tensor before the first backward.

Where each row's elements belong is FSDP's order (tagc/positions.py), so the state
also carries ``layout``: per unit, the FSDP layout by parameter name, the reducer's
form and the weight of a row in the average.  On the same shape (FSDP version, world
size, replicas, unit layout) the rows come back bit for bit; on another shape
:func:`remap` maps them through the parameter names: each buffer's rows are combined
by their rule (:data:`tagc.positions.COMBINE`: the residuals keep what they owe the
averaged gradient, which every new rank holding an element shares evenly, so on the
same reduction each new rank starts from the mean of the old ranks' residuals;
replicated outer state is taken as it is) and cut into the new rows.  What cannot be mapped (EF21's estimates, a layout FSDP gives
no positions for, a checkpoint written before layouts were stored) is refused, naming
it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import positions
from .config import TAGCConfig
from .reducer import UnitReducer

logger = logging.getLogger(__name__)

# v3 adds ``layout``; v2 (no layout) still loads on the shape it was written on
FORMAT = "tagc-state-v3"
FORMATS = ("tagc-state-v2", FORMAT)


class RowMeshes:
    """The CPU ``DeviceMesh`` of each process group, built once, for the rows."""

    def __init__(self) -> None:
        self._meshes: Dict[int, Any] = {}

    def rows(self, group: Any, local: torch.Tensor) -> Any:
        """``local`` (this rank's row, CPU) as row ``rank`` of a DTensor over ``group``."""
        from torch.distributed.tensor import DTensor, Shard

        if group is None:
            group = dist.group.WORLD
        mesh = self._meshes.get(id(group))
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            # "cpu": the rows are host copies; DCP moves only local shards and
            # never runs a collective on this mesh.
            mesh = self._meshes[id(group)] = DeviceMesh.from_group(group, "cpu")
        n = dist.get_world_size(group)
        shape = torch.Size([n * local.shape[0], *local.shape[1:]])
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())


def local_part(t: Any) -> torch.Tensor:
    """This rank's tensor of a state-dict entry: a DTensor's local shard, or the tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"load_state_dict: expected a tensor, got {type(t).__name__}")
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def state_dict(reducers: List[UnitReducer], cfg: TAGCConfig, kind: str, world: int,
               rank: int, meshes: RowMeshes) -> Dict[str, Any]:
    """The checkpoint dict of one rank (see the module docstring)."""
    units: Dict[str, Any] = {}
    for u in reducers:
        entry: Dict[str, Any] = {"index": u.index, "numel": u.numel,
                                 "flat_numel": u.flat_numel, "step": u.step}
        for name, length, dtype in u.state_buffers():
            t = getattr(u, name)
            entry[f"has_{name}"] = t is not None
            row = (torch.zeros(length, dtype=dtype) if t is None
                   else t.detach().to("cpu", copy=True))
            entry[name] = meshes.rows(u.row_group, row.reshape(1, -1))
        units[u.name] = entry
    return {
        "format": FORMAT,
        "kind": kind,
        "world_size": world,
        "seed": cfg.seed,
        "config": cfg.resolved_dict(),
        "rank": meshes.rows(reducers[0].row_group if reducers else None,
                            torch.tensor([rank], dtype=torch.int64)),
        "units": units,
        # one string: DCP keeps a non-tensor whole, where it would flatten a dict
        "layout": json.dumps(layout_record(reducers, kind, world)),
    }


def layout_record(reducers: List[UnitReducer], kind: str, world: int) -> Dict[str, Any]:
    """Where every row of every unit's state belongs: the checkpoint's ``layout``.

    Returns:
        ``{"kind", "world_size", "units": {name: positions.describe(...) + "buffers":
        [[name, length, dtype], ...]}}``; a unit without a known FSDP layout has
        ``layout`` ``{"form": "unknown"}``.
    """
    units = {}
    for u in reducers:
        layout = u.layout if u.layout is not None else {"form": "unknown",
                                                        "why": "no FSDP layout recorded"}
        entry = positions.describe(u, layout)
        entry["buffers"] = [[n, length, str(dtype).replace("torch.", "")]
                            for n, length, dtype in u.state_buffers()]
        units[u.name] = entry
    return {"kind": kind, "world_size": world, "units": units,
            "codec_format": codec_format()}


def codec_format() -> Optional[int]:
    """The C codec's code layout version (``TAGC_FORMAT_VERSION``); None without it."""
    from .codec import _tagc

    return None if _tagc is None else int(_tagc.FORMAT_VERSION)


# knobs that change how the hook runs, not what it computes (hsdp_overlap and
# fsdp_overlap give the blocking comms' values bit for bit): a checkpoint resumes
# under any value of them
HOW_ONLY = ("hsdp_overlap", "fsdp_overlap")


def _comparable(config: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in config.items() if k not in HOW_ONLY}


def _saved_config(saved: Dict[str, Any], cfg: TAGCConfig) -> Dict[str, Any]:
    """The saved config with the knobs added since it was written: a key it lacks
    counts as what the saved knobs resolve it to now (a checkpoint older than
    ``hsdp_out_format`` resumes under that knob's default, an EF21 one older than
    ``residual_code`` with the fp32 residual it holds), never as another value."""
    current = cfg.resolved_dict()
    lacking = [k for k in current if k not in saved]
    if not lacking:
        return saved
    known = {f.name for f in dataclasses.fields(TAGCConfig)}
    given = {k: v for k, v in saved.items() if k in known}
    if str(given.get("layers", "")).startswith("callable:"):
        given["layers"] = cfg.layers  # resolved_dict names a callable; compared as named
    try:
        then = TAGCConfig.from_dict(given).resolved_dict()
    except ValueError:
        return saved  # not a config this code builds: the comparison reports the difference
    return {**saved, **{k: then[k] for k in lacking}}


def config_difference(saved: Dict[str, Any], cfg: TAGCConfig) -> Optional[str]:
    """The knobs whose saved value differs from ``cfg``'s, in one line; None if none
    (knobs of :data:`HOW_ONLY` aside)."""
    then, now = _comparable(_saved_config(saved, cfg)), _comparable(cfg.resolved_dict())
    keys = sorted(set(then) | set(now), key=lambda k: (k not in now, k))
    diff = [f"{k}: saved {then.get(k, '(absent)')!r}, now {now.get(k, '(absent)')!r}"
            for k in keys if then.get(k) != now.get(k)]
    return "; ".join(diff) if diff else None


def restoring_overrides(saved: Dict[str, Any], cfg: TAGCConfig) -> str:
    """The ``--tagc_set`` that gives ``cfg`` the saved values of the knobs both have
    (values as JSON, which ``--tagc_set``'s YAML reads back)."""
    then, now = _comparable(_saved_config(saved, cfg)), _comparable(cfg.resolved_dict())
    pairs = [f"{k}={json.dumps(then[k])}" for k in sorted(now)
             if k in then and then[k] != now[k]]
    return "--tagc_set=" + ",".join(pairs)


def check_saved(saved: Dict[str, Any], reducers: List[UnitReducer], cfg: TAGCConfig,
                kind: str, world: int) -> bool:
    """Every check of a saved TAGC state against this run, before anything changes.

    Args:
        saved: ``format``, ``kind``, ``world_size``, ``config``, ``units`` (unit name ->
            its ``numel`` / ``flat_numel`` / ``index``) and, from v3 on, ``layout``.
        reducers, cfg, kind, world: this run.
    Returns:
        True when the rows load as they are (the same kind, world size, units and
        layout); False when :func:`remap` maps them onto this shape.
    Raises:
        ValueError: not a TAGC state, another config (the knobs named), units of other
            parameters, or another shape that cannot be mapped (what and why).
    """
    if not isinstance(saved, dict) or saved.get("format") not in FORMATS:
        raise ValueError(f"load_state_dict: not a TAGC state dict (format {FORMAT})")
    diff = config_difference(saved["config"], cfg)
    if diff is not None:
        raise ValueError(f"TAGC checkpoint: written with another TAGC config ({diff}); "
                         "resume with the same preset and overrides (a preset's values can "
                         "change between TAGC versions: "
                         f"{restoring_overrides(saved['config'], cfg)} restores these), or "
                         "start a new run from the model and optimizer alone")
    names = [u.name for u in reducers]
    if sorted(saved["units"]) != sorted(names):
        raise ValueError(f"TAGC checkpoint: unit layout differs: saved "
                         f"{sorted(saved['units'])}, current {sorted(names)} (the model or "
                         "its wrapping changed; wrap it as when the checkpoint was written)")
    shape = (saved["kind"], saved["world_size"])
    layout = saved.get("layout")
    if layout is None:  # v2
        if shape != (kind, world):
            raise ValueError(f"TAGC checkpoint: written by {saved['kind']} on "
                             f"{saved['world_size']} ranks, this run is {kind} on {world}; "
                             "the checkpoint predates stored layouts, so its feedback state "
                             "resumes only on the shape it was written on")
        for u in reducers:
            entry = saved["units"][u.name]
            if (entry["numel"], entry["flat_numel"], entry["index"]) != \
                    (u.numel, u.flat_numel, u.index):
                raise ValueError(f"load_state_dict: unit {u.name!r} differs (numel "
                                 f"{entry['numel']}/{entry['flat_numel']} saved, "
                                 f"{u.numel}/{u.flat_numel} now)")
        return True
    mine = layout_record(reducers, kind, world)
    coded = any(u.coded_residuals() for u in reducers)
    if coded and layout.get("codec_format") != mine["codec_format"]:
        raise ValueError(f"TAGC checkpoint: its residual codes are of codec format "
                         f"{layout.get('codec_format')}, this build writes and reads "
                         f"{mine['codec_format']}; resume with the TAGC release that wrote it, "
                         "or from the model and optimizer alone")
    if _same_layout(layout, mine):
        return True
    for u in reducers:
        old, new = layout["units"][u.name], mine["units"][u.name]
        for entry, when in ((old, "saved"), (new, "now")):
            if entry["layout"]["form"] == "unknown":
                raise ValueError(f"TAGC checkpoint: unit {u.name!r} cannot be mapped onto "
                                 f"another shape ({when}: {entry['layout']['why']}); resume "
                                 f"on the shape it was written on ({saved['kind']}, "
                                 f"{saved['world_size']} ranks)")
        a, b = positions.param_sizes(old["layout"]), positions.param_sizes(new["layout"])
        if a != b:
            bad = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"TAGC checkpoint: unit {u.name!r} holds other parameters "
                             f"than when saved ({', '.join(bad[:4])}: saved "
                             f"{[a.get(k) for k in bad[:4]]}, now {[b.get(k) for k in bad[:4]]} "
                             "elements)")
        held = {n for n, _, _ in old["buffers"]
                if saved["units"][u.name].get(f"has_{n}", True)}
        for n in held:
            if positions.COMBINE.get(n) is None:
                raise ValueError(f"TAGC checkpoint: {n!r} of unit {u.name!r} cannot be "
                                 f"mapped from {saved['kind']} on {saved['world_size']} ranks "
                                 f"to {kind} on {world} (EF21's estimates are sums over the "
                                 "ranks that held them); resume on the shape it was written "
                                 "on, or from the model and optimizer alone")
    return False


def _same_layout(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two layout records put every element in the same place (the weights
    aside: a float's text may differ in its last digit for the same value)."""
    def strip(rec: Dict[str, Any]) -> Any:
        return (rec["kind"], rec["world_size"], rec.get("codec_format"),
                {n: {k: v for k, v in e.items() if k != "weight"}
                 for n, e in rec["units"].items()})
    return strip(a) == strip(b)


def validate(sd: Dict[str, Any], reducers: List[UnitReducer], cfg: TAGCConfig, world: int,
             rank: int, kind: str = "") -> Dict[Tuple[str, str], Optional[torch.Tensor]]:
    """Every check of :meth:`TAGCState.load_state_dict` before anything changes.

    Returns:
        the rows to restore, keyed by (unit name, state name); None: no state yet.
    Raises:
        ValueError: format, config, kind, world size, rank, unit layout or a size differ
            (another shape: :meth:`TAGCState.load_dcp` maps it).
    """
    saved = saved_view(sd)
    if not check_saved(saved, reducers, cfg, kind or sd.get("kind", ""), world):
        raise ValueError(f"load_state_dict: written by {saved['kind']} on "
                         f"{saved['world_size']} ranks with another unit layout than this "
                         f"run's ({kind} on {world}); each rank holds only its own row here: "
                         "load through TAGCState.load_dcp(checkpoint_id), which maps the "
                         "rows by parameter name")
    saved_rank = int(local_part(sd["rank"]).reshape(-1)[0])
    if saved_rank != rank:
        raise ValueError(f"load_state_dict: saved by rank {saved_rank} of "
                         f"{sd['world_size']}, loading on rank {rank} of {world}")
    rows: Dict[Tuple[str, str], Optional[torch.Tensor]] = {}
    for u in reducers:
        entry = sd["units"][u.name]
        for name, length, _ in u.state_buffers():
            row = None
            if entry.get(f"has_{name}"):
                row = local_part(entry[name]).reshape(-1)
                if row.numel() != length:
                    raise ValueError(f"load_state_dict: unit {u.name!r}: {name} of "
                                     f"{row.numel()} elements, expected {length}")
            rows[u.name, name] = row
    return rows


def saved_view(sd: Dict[str, Any]) -> Dict[str, Any]:
    """What :func:`check_saved` reads of a state dict (``layout`` parsed)."""
    if not isinstance(sd, dict) or sd.get("format") not in FORMATS:
        raise ValueError(f"load_state_dict: not a TAGC state dict (format {FORMAT})")
    layout = sd.get("layout")
    return {"format": sd["format"], "kind": sd["kind"], "world_size": sd["world_size"],
            "config": sd["config"], "units": sd["units"],
            "layout": json.loads(layout) if isinstance(layout, str) else None}


def load_alone(state: Dict[str, Any], checkpoint_id: Any) -> None:
    """``dcp.load`` on this rank alone (no collective: every rank reads what it needs
    by itself; DCP's warning that it assumes one process says nothing here)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint_id), no_dist=True)


def read_saved(checkpoint_id: Any, key: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The TAGC state's plain entries in a DCP checkpoint, without its tensors.

    Args:
        checkpoint_id: the DCP checkpoint folder.
        key: the top-level key the state was saved under (``dcp.save({key: state})``).
    Returns:
        (:func:`saved_view`'s dict, tensor sizes by DCP key below ``key``).
    Raises:
        ValueError: no TAGC state under ``key``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = dcp.FileSystemReader(str(checkpoint_id)).read_metadata()
    prefix = key + "."
    flat: Dict[str, Any] = {k: None for k, v in md.state_dict_metadata.items()
                            if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)}
    sizes = {k[len(prefix):]: v.size for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix) and not isinstance(v, BytesStorageMetadata)}
    if f"{prefix}format" not in flat:
        raise ValueError(f"{checkpoint_id}: no TAGC state under {key!r} (a checkpoint "
                         "written without TAGC, or under another key)")
    load_alone(flat, checkpoint_id)
    plain = {k[len(prefix):]: v for k, v in flat.items()}
    units: Dict[str, Dict[str, Any]] = {}
    for k, v in plain.items():
        if k.startswith("units."):
            unit, _, field = k[len("units."):].rpartition(".")
            units.setdefault(unit, {})[field] = v
    layout = plain.get("layout")
    return ({"format": plain["format"], "kind": plain["kind"],
             "world_size": plain["world_size"],
             "config": {k[len("config."):]: v for k, v in plain.items()
                        if k.startswith("config.")},
             "units": units, "layout": json.loads(layout) if layout else None}, sizes)


def _canonical(entry: Dict[str, Any], name: str, held: torch.Tensor, coded: bool,
               cfg: TAGCConfig, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every saved row of one buffer added up in the canonical order (float64), and how
    many rows held each element."""
    from . import codec

    acc = torch.zeros(total, dtype=torch.float64)
    cover = torch.zeros(total, dtype=torch.float64)
    for r in range(held.shape[0]):
        idx = positions.buffer_index(entry, name, r)
        vals = held[r]
        if coded:
            work = torch.zeros(idx.numel(), dtype=torch.float32)
            codec._tagc.quant_decode_add(work, vals.contiguous(), cfg.residual_code,
                                         cfg.quant_block)
            vals = work
        keep = idx >= 0
        acc.index_add_(0, idx[keep], vals[:idx.numel()][keep].double())
        cover.index_add_(0, idx[keep], torch.ones(int(keep.sum()), dtype=torch.float64))
    return acc, cover


def remap(saved: Dict[str, Any], old_rows: Dict[Tuple[str, str], torch.Tensor],
          reducers: List[UnitReducer], cfg: TAGCConfig, kind: str, world: int,
          row: int) -> Dict[Tuple[str, str], Optional[torch.Tensor]]:
    """This rank's rows on this run's shape, from every row of a checkpoint written
    on another.

    What the residuals owe the averaged gradient (every ``sum`` buffer's rows times
    the unit's weight, HSDP's owner-side ``residual_out`` included) goes into the new
    ``residual`` rows, split evenly over the ranks that now hold each element; a new
    ``residual_out`` starts empty.  A ``same`` buffer (replicated outer state) takes
    the mean of the rows that held each element.

    Args:
        saved: :func:`read_saved`'s view (checked by :func:`check_saved`).
        old_rows: (unit, buffer) -> every saved row, ``(old rows, length)``; absent:
            the state did not exist yet.
        reducers, cfg, kind, world: this run.
        row: this rank's checkpoint row (its rank in the units' row group).
    Returns:
        the rows to restore, as :func:`validate` returns them.
    """
    from . import codec

    mine = layout_record(reducers, kind, world)["units"]
    rows: Dict[Tuple[str, str], Optional[torch.Tensor]] = {}
    for u in reducers:
        old, new = saved["layout"]["units"][u.name], mine[u.name]
        coded = u.coded_residuals()
        _, total = positions.canonical_offsets(new["layout"])
        owed, any_owed = torch.zeros(total, dtype=torch.float64), False
        for name, _, _ in old["buffers"]:
            held = old_rows.get((u.name, name))
            if held is not None and positions.COMBINE.get(name) == "sum":
                acc, _ = _canonical(old, name, held, name in coded, cfg, total)
                owed += acc * old["weight"]
                any_owed = True
        for name, length, dtype in u.state_buffers():
            how, idx = positions.COMBINE[name], positions.buffer_index(new, name, row)
            held = old_rows.get((u.name, name))
            if how == "sum":
                if name != "residual" or not any_owed:
                    rows[u.name, name] = None
                    continue
                holders = torch.zeros(total, dtype=torch.float64)
                for r in range(positions.row_group_size(new)):
                    ri = positions.buffer_index(new, name, r)
                    holders.index_add_(0, ri[ri >= 0],
                                       torch.ones(int((ri >= 0).sum()), dtype=torch.float64))
                value = owed / (holders.clamp(min=1) * new["weight"])
            elif held is None:
                rows[u.name, name] = None
                continue
            elif idx is None:  # step counters, alike on every row
                rows[u.name, name] = held[0].to(dtype).clone()
                continue
            else:
                acc, cover = _canonical(old, name, held, False, cfg, total)
                value = acc / cover.clamp(min=1)
            out = torch.zeros(idx.numel(), dtype=torch.float32)
            keep = idx >= 0
            out[keep] = value[idx[keep]].float()
            if name in coded:
                codes = torch.zeros(length, dtype=torch.uint8)
                codec._tagc.quant_encode(codes, None, out, cfg.residual_code, cfg.quant_block)
                out = codes
            rows[u.name, name] = out.to(dtype)
    return rows


def restore(sd: Dict[str, Any], reducers: List[UnitReducer],
            rows: Dict[Tuple[str, str], Optional[torch.Tensor]]) -> None:
    """Apply a validated checkpoint: steps and feedback state."""
    for u in reducers:
        u.step = int(sd["units"][u.name]["step"])
        for name, _, dtype in u.state_buffers():
            row, old = rows[u.name, name], getattr(u, name)
            dev = old.device if old is not None else u.device
            setattr(u, name, None if row is None else
                    row.detach().to(device=dev, dtype=dtype, copy=True).contiguous())
