"""Where each element of a unit's feedback state belongs: (parameter name, index).

A reducer's feedback state is indexed by position in the flat buffer FSDP hands the hook,
and that order is FSDP's, not the model's:

* FSDP1 (``flat``): the unit's parameters flattened one after the other (with
  ``use_orig_params`` alignment padding between them), then zeros up to N shards; rank
  r owns the r-th contiguous shard of that.
* FSDP2 (``rows``): N rows, row r = chunk r of every parameter in turn, each parameter's
  dim 0 padded to a multiple of N; so a parameter with a bias lands in other places
  than under FSDP1, and the same parameter in other places at another N.

So a checkpoint stores, beside each rank's row, this layout (:func:`describe`), and a
checkpoint resumed under another FSDP version, world size or replica count is mapped
through the canonical order: every parameter of the unit flattened, the parameters in
name order (:func:`canonical_index`).  The positions of one buffer of one rank are
:func:`buffer_index`; padding maps to -1.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from .selection import clean_name

# A unit's layout, JSON-able: {"form": "flat" | "rows", "world": N, ...}; see describe.
Layout = Dict[str, Any]


def _join(prefix: str, name: str) -> str:
    return clean_name(f"{prefix}.{name}" if prefix else name)


def fsdp1_layout(unit_name: str, flat_param: Any, world: int) -> Layout:
    """The layout of an FSDP1 unit.

    Args:
        unit_name: the FSDP module's FQN (wrapper names are dropped).
        flat_param: its ``FlatParameter``.
        world: ranks of its process group.
    Returns:
        ``{"form": "flat", "world": N, "length": padded length, "segments": [[fqn or
        None for padding, numel], ...]}``.
    """
    fqns = iter(flat_param._fqns)
    segs: List[List[Any]] = []
    for numel, pad in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
        segs.append([None if pad else _join(unit_name, next(fqns)), int(numel)])
    length = int(flat_param._sharded_size.numel()) * world
    return {"form": "flat", "world": world, "length": length, "segments": segs}


def fsdp2_layout(names: Dict[int, str], fsdp_params: List[Any], world: int) -> Layout:
    """The layout of an FSDP2 unit (only the parameters that get a gradient).

    Args:
        names: id(module) -> FQN (:func:`tagc.selection.module_names`).
        fsdp_params: the unit's ``FSDPParam``s.
        world: ranks of its shard group.
    Returns:
        ``{"form": "rows", "world": N, "params": [[fqn, dim0, width, chunk rows], ...]}``,
        or ``{"form": "unknown", "why": ...}`` when a parameter is not sharded on dim 0.
    """
    params = []
    for fp in fsdp_params:
        if not fp.sharded_param.requires_grad:
            continue
        placement = getattr(fp, "fsdp_placement", None)
        if placement is not None and getattr(placement, "dim", 0) != 0:
            return {"form": "unknown",
                    "why": f"parameter {fp._module_info.param_name!r} is sharded on dim "
                           f"{placement.dim}, not 0"}
        size = fp._orig_size
        dim0 = int(size[0]) if len(size) else 1
        width = int(math.prod(size[1:])) if len(size) > 1 else 1
        name = _join(names.get(id(fp._module_info.module), ""), fp._module_info.param_name)
        params.append([name, dim0, width, int(fp.padded_sharded_param_size[0])
                       if len(fp.padded_sharded_param_size) else 1])
    return {"form": "rows", "world": world, "params": params}


def param_sizes(layout: Layout) -> Dict[str, int]:
    """Parameter FQN -> numel of the parameters a layout covers."""
    if layout["form"] == "flat":
        return {n: k for n, k in layout["segments"] if n is not None}
    if layout["form"] == "rows":
        return {n: d * w for n, d, w, _ in layout["params"]}
    return {}


def canonical_offsets(layout: Layout) -> Tuple[Dict[str, int], int]:
    """Each parameter's offset in the canonical order (parameters in name order, each
    flattened), and the total."""
    off, total = {}, 0
    for name, numel in sorted(param_sizes(layout).items()):
        off[name] = total
        total += numel
    return off, total


def canonical_index(layout: Layout) -> torch.Tensor:
    """The canonical position of every element of the unit's whole flat buffer
    (FSDP1: the padded flat parameter; FSDP2: the N rows), -1 for padding.

    Returns:
        an int64 tensor of the buffer's length.
    """
    off, _ = canonical_offsets(layout)
    parts: List[torch.Tensor] = []
    if layout["form"] == "flat":
        for name, numel in layout["segments"]:
            parts.append(torch.full((numel,), -1, dtype=torch.int64) if name is None
                         else torch.arange(off[name], off[name] + numel, dtype=torch.int64))
        used = sum(p.numel() for p in parts)
        parts.append(torch.full((layout["length"] - used,), -1, dtype=torch.int64))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if layout["form"] != "rows":
        raise ValueError(f"no positions for a unit whose layout is {layout['form']!r}")
    for r in range(layout["world"]):
        for name, dim0, width, rows in layout["params"]:
            row = torch.arange(r * rows, (r + 1) * rows, dtype=torch.int64)
            idx = (off[name] + row.unsqueeze(1) * width
                   + torch.arange(width, dtype=torch.int64)).reshape(-1)
            idx[(row >= dim0).repeat_interleave(width)] = -1
            parts.append(idx)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _padded(idx: torch.Tensor, length: int) -> torch.Tensor:
    """``idx`` followed by padding (-1) up to ``length``."""
    if idx.numel() >= length:
        return idx[:length]
    return torch.cat([idx, torch.full((length - idx.numel(),), -1, dtype=torch.int64)])


def buffer_index(unit: Dict[str, Any], name: str, row: int) -> Optional[torch.Tensor]:
    """The canonical positions of buffer ``name`` of checkpoint row ``row``.

    Args:
        unit: a unit's entry of :func:`describe` (``layout``, ``reducer``, ``replicas``).
        name: the buffer (``residual``, ``estimate``, ``residual_out``, ``estimate_out``,
            ``outer_start``, ...).
        row: the checkpoint row (the rank in the unit's row group).
    Returns:
        an int64 tensor (-1: padding), or None for a buffer that is not positional
        (local steps' step counters).
    """
    layout, form = unit["layout"], unit["reducer"]
    whole = canonical_index(layout)
    n = layout["world"]
    if form == "fsdp":
        if name == "residual":
            return whole
        if name == "estimate":
            shard = whole.numel() // n
            return whole[row * shard:(row + 1) * shard]
        raise ValueError(f"unknown buffer {name!r} of an FSDP reducer")
    # TAGC's HSDP: rows are global ranks, each (replica q, shard s) of the mesh; the
    # shard is FSDP2's row s
    replicas = unit["replicas"]
    shard_len = whole.numel() // n
    q, s = next((q, line.index(row)) for q, line in enumerate(unit["grid"]) if row in line)
    shard = whole[s * shard_len:(s + 1) * shard_len]
    if name in ("outer_start", "outer_momentum", "outer_avg"):
        return shard
    if name == "outer_inner":
        return None
    if form == "gather":
        if name in ("residual", "estimate"):
            return shard
    elif form == "two-phase":
        chunk = math.ceil(shard_len / replicas)
        padded = _padded(shard, chunk * replicas)
        if name in ("residual", "estimate_out"):
            return padded
        if name == "residual_out":
            return padded[q * chunk:(q + 1) * chunk]
        if name == "estimate":
            return padded[q * chunk:(q + 1) * chunk]
    raise ValueError(f"unknown buffer {name!r} of a {form} reducer")


# How a buffer's rows combine into the value every new row starts from
# (:func:`tagc.checkpoint.remap`):
#   "sum": feedback owed to the average, which adds every row's share (residuals);
#   "same": a value every holder has alike (local steps' outer state);
#   None: not mapped (EF21's estimates: sums of N ranks' estimates of a shard, which
#   another N would have to re-learn).
COMBINE = {"residual": "sum", "residual_out": "sum", "outer_start": "same",
           "outer_momentum": "same", "outer_avg": "same", "outer_inner": "same",
           "estimate": None, "estimate_out": None}


def row_group_size(unit: Dict[str, Any]) -> int:
    """How many checkpoint rows a unit's buffers have."""
    n = unit["layout"]["world"]
    return n if unit["reducer"] == "fsdp" else n * unit["replicas"]


def describe(reducer: Any, layout: Layout) -> Dict[str, Any]:
    """A unit's entry in a checkpoint's layout record.

    Args:
        reducer: the unit's reducer (:class:`tagc.reducer.UnitReducer` or an HSDP one).
        layout: the FSDP layout of the unit (:func:`fsdp1_layout`, :func:`fsdp2_layout`).
    Returns:
        ``layout``, ``reducer`` (``fsdp``, ``gather``, ``two-phase``), ``replicas``,
        ``grid`` (HSDP: the mesh's global ranks, replica by shard) and ``weight``: the factor that turns a residual row into its share of the
        averaged gradient (1 / every divide the reduction applies), so that a
        checkpoint mapped onto another shape keeps what the rows owe the average.
    """
    form = reducer.FORM
    divide = float(getattr(reducer, "divide", 1.0))
    return {"layout": layout, "reducer": form,
            "replicas": reducer.world if form != "fsdp" else 1,
            "grid": getattr(reducer, "grid", []),
            "weight": 1.0 / (reducer.pre * reducer.post * divide)}
