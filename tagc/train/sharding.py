"""Sharding a model with FSDP1 or FSDP2, with TAGC's unit layout or one unit per block."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.train.config import RunConfig


def import_tagc() -> Any:
    """TAGC's entry points, from ``tagc/`` itself (what ``tagc_hook`` re-exports; the
    package never imports ``tagc_hook``): ``TAGCConfig``, ``register``,
    ``fsdp1_auto_wrap_policy`` and ``shard_model``.  A missing ``_tagc`` extension is
    reported by ``register`` (``tagc.codec.require_codec``)."""
    from tagc.config import TAGCConfig
    from tagc.state import register
    from tagc.wrapping import fsdp1_auto_wrap_policy, shard_model
    return SimpleNamespace(TAGCConfig=TAGCConfig, register=register,
                           fsdp1_auto_wrap_policy=fsdp1_auto_wrap_policy,
                           shard_model=shard_model)


def device_mesh(cfg: RunConfig, device: torch.device) -> Any:
    """FSDP2's mesh: every rank on one dimension, or with ``replicas`` > 1 the HSDP
    ``(replicate, shard)`` mesh (torchrun numbers ranks node by node, so a row is one
    node).  None for FSDP1.

    Args:
        cfg: run config.
        device: this rank's device.
    Returns:
        the mesh, or None.
    """
    if cfg.fsdp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    if cfg.replicas == 1:
        return init_device_mesh(device.type, (world,))
    if world % cfg.replicas:
        raise ValueError(f"replicas={cfg.replicas} does not divide the {world} ranks")
    return init_device_mesh(device.type, (cfg.replicas, world // cfg.replicas),
                            mesh_dim_names=("replicate", "shard"),
                            backend_override=_timeout_override(cfg.timeout, 2))


def _timeout_override(seconds: float, dims: int) -> Any:
    """init_device_mesh's ``backend_override`` that gives every dimension's new groups
    the run's collective timeout (without it they keep torch's 30 minutes, whatever the
    default group was given); None for a backend it does not know."""
    import datetime
    backend = dist.get_backend()
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    opts._timeout = datetime.timedelta(seconds=seconds)
    return {d: (backend, opts) for d in range(dims)}


def wrap_model(model: nn.Module, cfg: RunConfig, tagc_cfg: Any, device: torch.device,
               param_dtype: torch.dtype, blocks: Sequence[type], mesh: Any = None
               ) -> nn.Module:
    """Shard the model with FSDP1 or FSDP2.

    Unit layout: ``block`` puts each transformer block (a module of a class in
    ``blocks``) in its own unit (embeddings, final norm and a tied head stay in the root
    unit). ``tagc`` asks TAGC for its layout (``tagc.wrapping``), which separates the
    parameters the preset compresses from the others.

    Args:
        model: the model on `device`.
        cfg: run config.
        tagc_cfg: a TAGCConfig or None.
        device: this rank's device.
        param_dtype: compute dtype (bf16 on GPU by default); gradients are reduced in fp32.
        blocks: the transformer block classes (for the ``block`` layout).
        mesh: FSDP2's mesh (:func:`device_mesh`; None: made here).

    Returns:
        The FSDP1 root module, or the model itself with fully_shard applied (FSDP2).
    """
    wrap = cfg.wrap if cfg.wrap != "auto" else ("tagc" if tagc_cfg is not None else "block")
    tagc = import_tagc() if wrap == "tagc" else None
    if cfg.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = None
        if param_dtype != torch.float32:
            mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                buffer_dtype=param_dtype)
        policy = (tagc.fsdp1_auto_wrap_policy(model, tagc_cfg) if tagc is not None
                  else ModuleWrapPolicy(set(blocks)))
        return FSDP(model, auto_wrap_policy=policy, mixed_precision=mp,
                    sharding_strategy=ShardingStrategy[cfg.sharding],
                    device_id=device,  # torch.device("cpu") is how FSDP1 runs on gloo
                    use_orig_params=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mesh is None:
        mesh = device_mesh(cfg, device)
    kw: Dict[str, Any] = dict(mesh=mesh, reshard_after_forward=cfg.sharding == "FULL_SHARD")
    if param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                               reduce_dtype=torch.float32)
    if tagc is not None:
        return tagc.shard_model(model, tagc_cfg, **kw)
    for block in [m for m in model.modules() if isinstance(m, tuple(blocks))]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def grad_sync(model: nn.Module, fsdp: int, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro step: gradients are reduced only when sync is True."""
    if fsdp == 1:
        return contextlib.nullcontext() if sync else model.no_sync()
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
