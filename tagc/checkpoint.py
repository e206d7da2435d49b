"""TAGC state in checkpoints: ``torch.save`` per rank, or ``torch.distributed.checkpoint``.

Feedback state differs per rank, everything else is identical on every rank.  So each
unit's residual (and EF21 estimate) is a ``DTensor`` of global shape ``(N, length)``
sharded by row over the unit's process group: DCP writes every rank's row and reads each
row back into its rank (a plain tensor under one key would be de-duplicated as if
replicated: one rank's state for all).  ``rank`` is an ``(N,)`` DTensor holding each
rank's own number, so a per-rank file loaded on the wrong rank is refused.  A unit
whose state does not exist yet gets zeros and ``has_<name>=False``: the template DCP
loads into must hold every tensor before the first backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .config import TAGCConfig
from .reducer import UnitReducer

FORMAT = "tagc-state-v2"


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
    }


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


def validate(sd: Dict[str, Any], reducers: List[UnitReducer], cfg: TAGCConfig, world: int,
             rank: int) -> Dict[Tuple[str, str], Optional[torch.Tensor]]:
    """Every check of :meth:`TAGCState.load_state_dict` before anything changes.

    Returns:
        the rows to restore, keyed by (unit name, state name); None: no state yet.
    Raises:
        ValueError: format, config, world size, rank, unit layout or a size differ.
    """
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ValueError(f"load_state_dict: not a TAGC state dict (format {FORMAT})")
    if _comparable(_saved_config(sd["config"], cfg)) != _comparable(cfg.resolved_dict()):
        raise ValueError(f"load_state_dict: config differs: saved {sd['config']}, "
                         f"current {cfg.resolved_dict()}")
    saved_rank = int(local_part(sd["rank"]).reshape(-1)[0])
    if sd["world_size"] != world or saved_rank != rank:
        raise ValueError(f"load_state_dict: saved by rank {saved_rank} of "
                         f"{sd['world_size']}, loading on rank {rank} of {world}")
    names = [u.name for u in reducers]
    if sorted(sd["units"]) != sorted(names):
        raise ValueError(f"load_state_dict: unit layout differs: saved "
                         f"{sorted(sd['units'])}, current {sorted(names)}")
    rows: Dict[Tuple[str, str], Optional[torch.Tensor]] = {}
    for u in reducers:
        entry = sd["units"][u.name]
        if (entry["numel"], entry["flat_numel"], entry["index"]) != \
                (u.numel, u.flat_numel, u.index):
            raise ValueError(f"load_state_dict: unit {u.name!r} differs (numel "
                             f"{entry['numel']}/{entry['flat_numel']} saved, "
                             f"{u.numel}/{u.flat_numel} now)")
        for name, length, _ in u.state_buffers():
            row = None
            if entry.get(f"has_{name}"):
                row = local_part(entry[name]).reshape(-1)
                if row.numel() != length:
                    raise ValueError(f"load_state_dict: unit {u.name!r}: {name} of "
                                     f"{row.numel()} elements, expected {length}")
            rows[u.name, name] = row
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
