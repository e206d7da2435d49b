"""Checkpoints of a training run (``out_dir/ckpt``).

Model, optimizer and TAGC state (each rank's residuals, step counters, seeds) go through
torch.distributed.checkpoint, plus one ``rank{r}.pt`` per rank with that rank's RNG
state, and ``train_state.json`` (iteration, world size, config) written last by rank 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.train.config import RunConfig


@contextlib.contextmanager
def _quiet_checkpoint_warnings() -> typing.Iterator[None]:
    """FSDP1's sharded state dict path warns about its own deprecated internals on every
    call; they say nothing about this script, so keep them out of the training log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


def _replica_key(tagc_state: Any) -> str:
    """Local steps (TAGC's ``outer_every``): ``replica<r>``, else ``""``.  Mid-round each
    replica's parameters and optimizer state are its own, while DCP keeps one copy of
    every (key, shard) it sees on several ranks: under shared keys one replica's state
    would silently stand for all."""
    outer = getattr(tagc_state, "local", None)
    return f"replica{dist.get_rank(outer.group)}" if outer is not None else ""


def _key(tagc_state: Any, scope: str) -> str:
    """The top-level key of this rank's model and optimizer state: ``scope`` (a
    pipeline stage: the stages' parameter names overlap), this replica's (local
    steps), or ``""`` (none)."""
    return scope or _replica_key(tagc_state)


def _keyed(key: str, sd: Dict[str, Any]) -> Dict[str, Any]:
    """``sd`` under ``key``, or as it is when the key is empty."""
    return {key: sd} if key else dict(sd)


def _tagc_key(scope: str) -> str:
    """Where the TAGC state goes: each stage's under its own key, since the stages'
    unit names overlap too."""
    return f"tagc.{scope}" if scope else "tagc"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, iter_num: int, cfg: RunConfig, scope: str = "") -> None:
    """Write a checkpoint atomically (all ranks call this).

    Model, optimizer and TAGC state go through torch.distributed.checkpoint (each rank
    writes its shards and its own residual rows); the RNG state through torch.save into
    rank{r}.pt. The directory is assembled as path.tmp and renamed when complete.

    Args:
        path, model, optimizer, tagc_state, iter_num, cfg: what is saved, and where.
        scope: the key this rank's part of the model lives under when the ranks hold
            different modules (``stage<s>`` of a pipeline); "" when every rank holds
            a shard or a replica of one model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank = dist.get_rank()
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    with _quiet_checkpoint_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: Dict[str, Any] = _keyed(_key(tagc_state, scope),
                                       {"model": model_sd, "optim": optim_sd})
        if tagc_state is not None:
            # a DCP Stateful: state_dict() now, per-rank rows
            state[_tagc_key(scope)] = tagc_state
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save({"rng": torch.get_rng_state(), "iter_num": iter_num}, tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "train_state.json").write_text(json.dumps(
            {"iter_num": iter_num, "world_size": dist.get_world_size(),
             "config": dataclasses.asdict(cfg)}, indent=1))
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, cfg: RunConfig, scope: str = "",
                    match: Sequence[str] = ()) -> int:
    """Restore what save_checkpoint wrote (with the same ``scope``); returns the
    iteration to continue from.

    Args:
        path, model, optimizer, tagc_state, cfg: where from, and what is restored.
        scope: as for :func:`save_checkpoint`.
        match: config fields that must equal the saved run's (a pipeline's stage
            count and codes decide what each rank's part is).

    Raises:
        FileNotFoundError: no complete checkpoint at path.
        ValueError: the checkpoint was written with another world size, TAGC setting
            or value of a ``match`` field.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    meta_path = path / "train_state.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    meta = json.loads(meta_path.read_text())
    for key in match:
        if meta["config"].get(key) != getattr(cfg, key):
            raise ValueError(f"{path}: written with {key}={meta['config'].get(key)!r}, "
                             f"this run has {key}={getattr(cfg, key)!r}")
    if meta["world_size"] != dist.get_world_size():
        raise ValueError(f"checkpoint has world size {meta['world_size']}, this run "
                         f"{dist.get_world_size()} (the per-rank TAGC residuals need the same)")
    saved_tagc = meta["config"].get("tagc")
    if (saved_tagc is None) != (cfg.tagc is None):
        raise ValueError(f"checkpoint was written with tagc={saved_tagc}, this run uses "
                         f"tagc={cfg.tagc}")
    with _quiet_checkpoint_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        key = _key(tagc_state, scope)
        state = _keyed(key, {"model": model_sd, "optim": optim_sd})
        if tagc_state is not None:
            # dcp.load calls its load_state_dict (checks config)
            state[_tagc_key(scope)] = tagc_state
        dcp.load(state, checkpoint_id=str(path))
        mine = state[key] if key else state
        set_state_dict(model, optimizer, model_state_dict=mine["model"],
                       optim_state_dict=mine["optim"])
    local = torch.load(path / f"rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(local["rng"])
    return int(local["iter_num"])
