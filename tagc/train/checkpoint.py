"""Checkpoints of a training run (``out_dir/ckpt``).

Each save is a folder ``out_dir/ckpt/step-<iteration>``: model, optimizer and TAGC state
(each rank's residuals, step counters, seeds) through torch.distributed.checkpoint, one
``rank{r}.pt`` per rank with that rank's RNG state, ``train_state.json`` (iteration,
world size, config) and ``checksums.json`` (the SHA-256 of every other file), written
last by rank 0.  A folder is assembled as ``.tmp`` and renamed when complete, and the
newest ``keep_checkpoints`` are kept, so a save that fails or a state that went bad
never leaves a run without the checkpoint before it.

On load every file's checksum is checked (a corrupted file is refused by name;
``--resume_from previous`` takes the one before), TAGC's state is checked against the
run before anything changes (tagc/checkpoint.py), and a run of another world size,
FSDP version or replica count resumes: DCP reshards model and optimizer, TAGC maps its
feedback state by parameter name.  A checkpoint written before folders and checksums
(``train_state.json`` directly in ``out_dir/ckpt``) loads with one warning.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.train.config import RunConfig

logger = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
STATE = "train_state.json"


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


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """The complete checkpoints under ``root``, oldest first: (iteration, folder); a
    checkpoint of the single-folder form before keep_checkpoints is ``root`` itself."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() \
                    and (d / STATE).exists():
                found.append((int(d.name[5:]), d))
        if (root / STATE).exists():
            found.append((read_state(root)["iter_num"], root))
    return sorted(found, key=lambda t: (t[0], t[1] != root))


def read_state(folder: Path) -> Dict[str, Any]:
    """A checkpoint's ``train_state.json``.

    Raises:
        ValueError: unreadable, naming the file.
    """
    path = folder / STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint file {path} is unreadable ({exc}); resume from "
                         "the one before it with --resume_from previous") from exc


def verify(folder: Path) -> None:
    """Check every file of a checkpoint against ``checksums.json``.

    Raises:
        ValueError: a file is missing or its checksum differs (named, with what to do).
    """
    listed = folder / CHECKSUMS
    if not listed.exists():
        warnings.warn(f"checkpoint {folder} has no {CHECKSUMS} (written before checksums "
                      "were stored): its files are loaded unchecked", stacklevel=2)
        return
    sums = json.loads(listed.read_text())
    for name, digest in sorted(sums.items()):
        f = folder / name
        if not f.exists():
            raise ValueError(f"checkpoint {folder}: file {name} is missing; resume from "
                             "the one before it with --resume_from previous")
        if _digest(f) != digest:
            raise ValueError(f"checkpoint {folder}: file {f} is corrupted (its SHA-256 "
                             f"differs from {CHECKSUMS}); resume from the one before it "
                             "with --resume_from previous")


def choose(root: Path, which: str) -> Path:
    """The checkpoint folder ``which`` names (``latest``, ``previous``, a step).

    Raises:
        FileNotFoundError: there is none such.
    """
    found = checkpoints(root)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint at {root}")
    if which == "latest":
        return found[-1][1]
    if which == "previous":
        if len(found) < 2:
            raise FileNotFoundError(f"{root} holds one checkpoint (step {found[0][0]}), no "
                                    "previous one")
        return found[-2][1]
    steps = {it: d for it, d in found}
    if int(which) not in steps:
        raise FileNotFoundError(f"{root} has no checkpoint of step {which} (steps "
                                f"{sorted(steps)})")
    return steps[int(which)]


def _prune(root: Path, keep: int, iter_num: int) -> None:
    """Remove the checkpoints of steps after ``iter_num`` (a run resumed from an
    earlier one has left that timeline: a resume must not go back to it), then all
    but the newest ``keep`` (rank 0)."""
    for it, d in checkpoints(root):
        if it > iter_num and d != root:
            logger.warning("removing checkpoint %s: newer than this run's step %d, from "
                           "before it resumed from an earlier one", d, iter_num)
            shutil.rmtree(d)
    found = checkpoints(root)
    for _, d in found[:-keep] if keep < len(found) else []:
        if d == root:  # the single-folder form: its files only
            for f in list(d.iterdir()):
                if f.is_file():
                    f.unlink()
        else:
            shutil.rmtree(d)


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, iter_num: int, cfg: RunConfig, scope: str = "",
                    rank_state: Optional[Dict[str, Any]] = None) -> Path:
    """Write a checkpoint atomically (all ranks call this) into ``path/step-<iter_num>``.

    Model, optimizer and TAGC state go through torch.distributed.checkpoint (each rank
    writes its shards and its own residual rows); the RNG state through torch.save into
    rank{r}.pt; then rank 0 writes train_state.json and the checksums.  The folder is
    assembled as ``.tmp`` and renamed when complete; then all but the newest
    ``cfg.keep_checkpoints`` are removed, and any of a later step (a run resumed from
    an earlier checkpoint continues from there, not from what came after it).

    Args:
        path, model, optimizer, tagc_state, iter_num, cfg: what is saved, and where
            (``path``: the run's checkpoint folder, ``out_dir/ckpt``).
        scope: the key this rank's part of the model lives under when the ranks hold
            different modules (``stage<s>`` of a pipeline); "" when every rank holds
            a shard or a replica of one model.
        rank_state: this rank's own state beside TAGC's (torchft's replica group:
            tagc/train/ft.py), saved with its RNG state in rank{r}.pt.
    Returns:
        the checkpoint's folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank = dist.get_rank()
    final = path / f"step-{iter_num:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
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
    torch.save({"rng": torch.get_rng_state(), "iter_num": iter_num,
                **({"rank_state": rank_state} if rank_state is not None else {})},
               tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / STATE).write_text(json.dumps(
            {"iter_num": iter_num, "world_size": dist.get_world_size(),
             "config": dataclasses.asdict(cfg)}, indent=1))
        sums = {f.name: _digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1))
        if final.exists():  # the same step saved again (a resumed run's first save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(path, cfg.keep_checkpoints, iter_num)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, cfg: RunConfig, scope: str = "",
                    match: Sequence[str] = (),
                    rank_state: Optional[Dict[str, Any]] = None) -> int:
    """Restore what save_checkpoint wrote (with the same ``scope``); returns the
    iteration to continue from.

    Which checkpoint: ``cfg.resume_from`` (latest, previous or a step).  Its files'
    checksums are checked first, then the saved config's ``match`` fields and TAGC's
    state against this run, and only then is anything loaded.

    Args:
        path, model, optimizer, tagc_state, cfg: where from (``out_dir/ckpt``), and
            what is restored.
        scope: as for :func:`save_checkpoint`.
        match: config fields that must equal the saved run's (a pipeline's stage
            count and codes decide what each rank's part is).
        rank_state: filled with what :func:`save_checkpoint` got as its
            ``rank_state`` on this rank (an error if it got none).

    Raises:
        FileNotFoundError: no complete checkpoint at path.
        ValueError: a corrupted or unreadable file, another TAGC setting or value of a
            ``match`` field, or a shape change the state cannot follow (each named,
            with what to do).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    folder = choose(path, cfg.resume_from)
    meta = read_state(folder)
    verify(folder)
    for key in match:
        if meta["config"].get(key) != getattr(cfg, key):
            raise ValueError(f"{folder}: written with {key}={meta['config'].get(key)!r}, "
                             f"this run has {key}={getattr(cfg, key)!r}")
    saved_tagc = meta["config"].get("tagc")
    if (saved_tagc is None) != (cfg.tagc is None):
        raise ValueError(f"{folder}: written with tagc={saved_tagc}, this run uses "
                         f"tagc={cfg.tagc}; resume with --tagc={saved_tagc}")
    world = dist.get_world_size()
    reshaped = meta["world_size"] != world
    key = _key(tagc_state, scope)
    if reshaped and (scope or key):
        raise ValueError(f"{folder}: written on {meta['world_size']} ranks, this run has "
                         f"{world}; {'pipeline stages' if scope else 'local steps'' replicas'} "
                         "keep their own model state, which does not reshard: resume on "
                         f"{meta['world_size']} ranks")
    if tagc_state is not None:  # every check before anything is loaded
        tagc_state.check_dcp(folder, _tagc_key(scope))
    with _quiet_checkpoint_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = _keyed(key, {"model": model_sd, "optim": optim_sd})
        dcp.load(state, checkpoint_id=str(folder))
        mine = state[key] if key else state
        set_state_dict(model, optimizer, model_state_dict=mine["model"],
                       optim_state_dict=mine["optim"])
    if tagc_state is not None:
        tagc_state.load_dcp(folder, _tagc_key(scope))
    if reshaped or meta["config"].get("fsdp") != getattr(cfg, "fsdp", None):
        logger.info("resumed a checkpoint of %d ranks (FSDP%s) on %d ranks (FSDP%s)",
                    meta["world_size"], meta["config"].get("fsdp"), world,
                    getattr(cfg, "fsdp", None))
    rng = folder / f"rank{dist.get_rank()}.pt"
    own = torch.load(rng, weights_only=True) if rng.exists() else {}
    if rank_state is not None:
        if "rank_state" not in own:
            raise ValueError(f"{folder}: no state of this rank's replica group in "
                             f"{rng.name} (written without --ft_lighthouse?)")
        rank_state.update(own["rank_state"])
    if "rng" in own:
        torch.set_rng_state(own["rng"])
    return int(meta["iter_num"])
