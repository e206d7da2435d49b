"""FSDP1 glue: every use of ``FullyShardedDataParallel`` internals is here.

``register_comm_hook`` is root-only and gives every unit the same ``(state, hook)``;
the hook gets ``(state, padded_flat_grad, output_shard)`` on FSDP's post-backward stream
and does all division itself.  No unit identity is passed, so each FSDP module's
``_comm_hook_state`` is replaced by its own :class:`UnitReducer` (residuals follow the
unit, never numel or call order).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import TAGCConfig
from . import positions
from .device import CodecStreams
from .reducer import UnitReducer
from .selection import module_names, unit_spec


def hook(reducer: UnitReducer, padded_grad: torch.Tensor,
         output: Optional[torch.Tensor] = None) -> None:
    """The FSDP1 comm hook; FSDP passes each unit its own reducer (see register)."""
    if output is None:
        # NO_SHARD: register() admits it only with one rank (FSDP1 switches to it
        # by itself at world size 1), where the reduction is the identity.
        if reducer.world != 1:
            raise RuntimeError("TAGC: NO_SHARD is not supported with more than one rank")
        reducer.stats.add("calls", 1)
        reducer.stats.add("plain_calls", 1)
        if reducer.pre * reducer.post != 1:
            padded_grad.div_(reducer.pre * reducer.post)
        return
    reducer.reduce(padded_grad, output)


def _check_strategies(fsdp_mods: List[Tuple[str, nn.Module]]) -> None:
    from torch.distributed.fsdp import ShardingStrategy

    for name, m in fsdp_mods:
        if m._comm_hook is not None:
            raise RuntimeError(f"register: a communication hook is already registered on "
                               f"{name or '<root>'!r} (TAGC registered twice?)")
        strat = m.sharding_strategy
        if strat in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            raise ValueError(f"register: sharding strategy {strat.name} is not supported "
                             "(FSDP1 refuses comm hooks on hybrid sharding); for HSDP use "
                             "FSDP2: tagc.shard_model(model, cfg, mesh=init_device_mesh("
                             "device, (replicas, shards), mesh_dim_names=('replicate', "
                             "'shard'))), then tagc.register(model, cfg)")
        if strat == ShardingStrategy.NO_SHARD and dist.get_world_size(m.process_group) > 1:
            raise ValueError("register: sharding strategy NO_SHARD is not supported (it is "
                             "data parallel without sharding; use DDP and its comm hooks)")


def reducers(model: nn.Module, cfg: TAGCConfig, streams: CodecStreams
             ) -> Tuple[List[UnitReducer], List[nn.Module], object]:
    """One reducer per FSDP1 unit with parameters, its module, and the shard group.

    Raises:
        ValueError: not the root, or a sharding strategy TAGC cannot hook.
        RuntimeError: a comm hook is already registered.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not model.check_is_root():
        raise ValueError("register: pass the root FSDP module (FSDP1 hooks are root-only)")
    names = module_names(model)
    fsdp_mods = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    _check_strategies(fsdp_mods)
    group = model.process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: List[UnitReducer] = []
    mods: List[nn.Module] = []
    for name, m in fsdp_mods:
        handle = m._handle
        if handle is None:
            continue
        fp = handle.flat_param
        infos = []
        for pi, numel, shape in zip(fp._param_infos, fp._numels, fp._shapes):
            p = getattr(pi.module, pi.param_name, None)
            if not isinstance(p, torch.Tensor) or p.numel() != numel:
                # use_orig_params=False removed the original; describe it by shape
                p = torch.empty(shape, dtype=fp.dtype, device="meta")
            infos.append((pi.module, pi.param_name, p, numel))
        flat = int(fp._sharded_size.numel()) * dist.get_world_size(m.process_group)
        spec = unit_spec(cfg, names, name, len(out), infos, flat, handle.device)
        out.append(UnitReducer(cfg, spec, m.process_group, rank, world,
                               float(m._gradient_predivide_factor),
                               float(m._gradient_postdivide_factor), streams))
        out[-1].layout = positions.fsdp1_layout(name, fp, dist.get_world_size(m.process_group))
        mods.append(m)
    return out, mods, group


def install(model: nn.Module, reducers_: List[UnitReducer], mods: List[nn.Module]) -> None:
    """Register the hook, then give each unit its own reducer as hook state."""
    model.register_comm_hook(reducers_[0] if reducers_ else None, hook)
    for m, r in zip(mods, reducers_):
        m._comm_hook_state = r
