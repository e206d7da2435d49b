"""The wrapping helpers: the unit layout of :func:`~tagc.selection.modules_to_wrap` applied.

:func:`fsdp1_auto_wrap_policy` (FSDP1's ``auto_wrap_policy``) and :func:`shard_model`
(FSDP2's ``fully_shard``, custom HSDP with a 2-D mesh) give every selected module, and
every big unselected ``nn.Linear``/``nn.Embedding``, its own unit, so that the rule "a
unit is compressed when selected parameters hold half of it" is exact for them
(docs/DESIGN.md section 6).  A module whose parameters its parent's forward reads
directly instead of calling it (``nn.MultiheadAttention.out_proj``) never gets a unit of
its own: FSDP gathers a unit only when its module is called, so the parent would compute
with sharded parameters (FSDP2: "got mixed torch.Tensor and DTensor"); it stays in the
parent's unit (:func:`~tagc.selection.direct_reads` says which modules those are).
Public torch API only: torch internals stay in ``fsdp1.py``/``fsdp2.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from .config import TAGCConfig
from .hsdp import check_mesh
from .selection import modules_to_wrap


def fsdp1_auto_wrap_policy(model: nn.Module, cfg: TAGCConfig) -> Callable[..., bool]:
    """FSDP1 ``auto_wrap_policy`` putting selected parameters in their own units.

    Every module owning a selected parameter, and every other ``nn.Linear``/
    ``nn.Embedding`` with at least ``min_numel`` parameters, becomes one unit;
    everything else (norms, position embeddings, tied weights) stays in the root.
    Except a module whose parameters an ancestor's forward reads directly: it stays in
    that reader's unit, and the reader becomes a unit in its place
    (:func:`~tagc.selection.modules_to_wrap`).  Known: ``nn.MultiheadAttention``'s
    ``out_proj`` (so the attention is one unit) and every child of
    ``nn.TransformerEncoderLayer``, whose eval fast path reads all its weights (so the
    layer is one unit; ``nn.TransformerDecoderLayer`` calls its children and is split
    as usual); other readers are found by a scan of each class's ``forward`` source
    for ``self.child.weight``-style reads.  A read the scan cannot see (through a
    local name, an index or ``getattr``) still fails at the first forward.

    Args:
        model: the unwrapped model (the policy is computed from it).
        cfg: the config whose ``layers``/``min_numel`` decide the selection.
    Returns:
        a callable ``(module, recurse, nonwrapped_numel) -> bool`` for
        ``FullyShardedDataParallel(model, auto_wrap_policy=...)``.
    Raises:
        ValueError: ``cfg.layers`` is a callable selecting parameters of such a kept
            module (named in the message) whose unit would then not be compressed; the
            message says which of the unit's other parameters to select.  With
            ``layers`` a string the same case is a logged warning.
    """
    wrap_ids = {id(m) for m in modules_to_wrap(model, cfg)}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        return id(module) in wrap_ids

    return policy


def shard_model(model: nn.Module, cfg: TAGCConfig, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2: ``fully_shard`` each module of :func:`fsdp1_auto_wrap_policy`'s set, then the root.

    With ``mesh=`` a 2-D ``(replicate, shard)`` mesh this is TAGC's custom HSDP
    (``tagc/hsdp.py``): every unit is sharded over the "shard" dimension only (inside
    a node) and ``register(model, cfg, mesh=mesh)`` then compresses the all-reduce
    between the replicas.

    The same units as the FSDP1 policy, so a module whose parameters its parent reads
    directly (``nn.MultiheadAttention.out_proj``) stays in the parent's unit; see
    :func:`fsdp1_auto_wrap_policy` for which ones are found and what is refused.
    Nothing runs: the layout is decided from the modules and their classes' source
    before any ``fully_shard``.

    Args:
        model: the unsharded model.
        cfg: the config deciding the selection.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (mesh, mp_policy, ...).
    Returns:
        the model (sharded in place; it is an ``FSDPModule`` afterwards).
    Raises:
        ValueError: a mesh that is neither 1-D nor the (replicate, shard) layout;
            ``cfg.layers`` a callable that selects parameters of a module kept in its
            reader's unit, which would then not be compressed (the message names the
            module and the parameters to select too).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = fully_shard_kwargs.get("mesh")
    if mesh is not None and mesh.ndim != 1:
        check_mesh(mesh)
        # register(model, cfg, mesh=mesh) then hooks the all-reduce over "replicate"
        fully_shard_kwargs = dict(fully_shard_kwargs, mesh=mesh["shard"])
    mods = modules_to_wrap(model, cfg)
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    for mod in sorted(mods, key=lambda m: -order[id(m)]):  # children before parents
        fully_shard(mod, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model
