"""The training script's torchft mode (``--ft_lighthouse``): this torchrun job is one
replica group of a torchft run (docs/TORCHFT.md).

Inside the group FSDP2 shards the model as usual; between groups a ``torchft.Manager``
forms quorums, and the groups average over them every step (each unit's gradient shard:
TAGC's :func:`tagc.ft.register`, or torchft's fp32 ``Manager.allreduce``) or every H
steps (local steps: TAGC's :class:`tagc.ft.FTLocalSteps`, or torchft's ``DiLoCo``
with its fp32 all-reduce).  An exchange that failed (a peer died) is not committed:
per step the optimizer does not step, TAGC's feedback state rolls back, and the step
runs again with the next quorum; with local steps the fragment's next sync sends
that round's steps too.  A group that starts late or restarts heals from a live peer through
torchft's recovery: the model, the optimizer and the step (:func:`local_state`; the
outer loop adds its own).
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

# what the integration needs of torchft: Manager(init_sync=..., min_replica_size=...),
# participating_rank(), num_participants(), ProcessGroupGloo(timeout=...)
TORCHFT_NEEDED = "0.2.0"


def import_torchft() -> Any:
    """torchft, or a clear error naming the extra and the version this needs.

    Returns:
        the ``torchft`` module.
    Raises:
        SystemExit: not installed, or an older version.
    """
    try:
        import torchft
        from torchft.manager import Manager  # noqa: F401 - what the mode uses
        from torchft.process_group import ProcessGroupGloo  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"--ft_lighthouse needs torchft >= {TORCHFT_NEEDED} "
                         f"(pip install 'tagc[ft]'): {exc}") from None
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("torchft")
    except PackageNotFoundError:
        have = getattr(torchft, "__version__", "unknown")
    if tuple(int(p) for p in have.split(".")[:2] if p.isdigit()) < (0, 2):
        raise SystemExit(f"--ft_lighthouse needs torchft >= {TORCHFT_NEEDED}, found {have}")
    return torchft


def _local(t: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """This rank's model and optimizer shards as plain tensors: what a healing peer's
    same-ranked process loads (replica groups have the same shape, so shards match).

    Args:
        model: the FSDP2 model.
        optimizer: its optimizer.
    Returns:
        ``{"model": name -> tensor, "optim": optimizer state dict with local tensors}``,
        copies.
    """
    def copy(v: Any) -> Any:
        # torchft serves a CPU tensor as it is while this replica trains on (streamed
        # local steps step meanwhile): a copy, taken only when a peer heals
        v = _local(v)
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    osd = optimizer.state_dict()
    return {"model": {k: copy(v) for k, v in model.state_dict().items()},
            "optim": {"state": {i: {k: copy(v) for k, v in s.items()}
                                for i, s in osd["state"].items()},
                      "param_groups": osd["param_groups"]}}


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                     sd: Dict[str, Any]) -> None:
    """Load :func:`local_state`'s output in place: model shards copied, the optimizer's
    tensors wrapped back as DTensors of their parameters' placement.

    Args:
        model: the FSDP2 model.
        optimizer: its optimizer.
        sd: a peer's :func:`local_state`.
    Raises:
        KeyError: a parameter the peer's state lacks (another model).
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for k, v in model.state_dict().items():
            _local(v).copy_(sd["model"][k])
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def like(v: Any, p: torch.Tensor) -> Any:
        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) \
                and v.shape == p.to_local().shape and v.dim() > 0:
            return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return v

    state = {i: {k: like(v, params[int(i)]) for k, v in s.items()}
             for i, s in sd["optim"]["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": sd["optim"]["param_groups"]})


class _Observed:
    """The manager as the fp32 hooks and DiLoCo see it: each all-reduce that crosses a
    link counted as the fp32 ring all-reduce torchft's gloo group runs, each vote
    recorded on the group (everything else is the manager's, or TAGC's
    :class:`~tagc.ft.FTManager`'s)."""

    def __init__(self, inner: Any, group: "ReplicaGroup", count: bool) -> None:
        self.inner, self.group, self.count = inner, group, count

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: Any = None) -> Any:
        self.group.exchange_started()
        r = self.group.manager.num_participants()
        if self.count and r > 1:
            self.group.fp32_sent += tensor.numel() * tensor.element_size() * 2 * (r - 1) / r
        if reduce_op is None:
            return self.inner.allreduce(tensor, should_quantize=should_quantize)
        return self.inner.allreduce(tensor, should_quantize=should_quantize,
                                    reduce_op=reduce_op)

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        ok = self.inner.should_commit(timeout) if timeout is not None \
            else self.inner.should_commit()
        self.group.record(ok)
        return ok

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: no recursion through this method
            raise AttributeError(name)
        return getattr(self.inner, name)


class _PlainHook:
    """A unit's all-reduce hook through torchft's own ``Manager.allreduce`` (fp32;
    torchft reports a failure to the manager itself)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def __call__(self, t: torch.Tensor) -> None:
        self.manager.allreduce(t).wait()


class ReplicaGroup:
    """This torchrun job as one replica group: the manager, the exchange between
    groups, the votes, the heals, and the bytes between groups.

    Two modes.  Per step (a preset without ``outer_every``, or none): every unit's
    gradient shard is averaged over the quorum after its reduce-scatter (TAGC's
    :func:`tagc.ft.register`, or torchft's fp32 all-reduce), one quorum and one vote a
    step.  Local steps (``outer_every`` H): TAGC's own outer loop over the quorum
    (:class:`tagc.ft.FTLocalSteps`: a quorum and a vote per fragment's sync);
    with ``--ft_allreduce torchft`` torchft's ``DiLoCo`` instead, fp32 (one fragment,
    Nesterov SGD with the preset's ``outer_lr`` / ``outer_momentum``,
    ``outer_overlap`` as its fragment delay, ``outer_mix`` as its merge): the
    baseline.

    Args:
        cfg: the run config (``ft_*``, ``timeout``).
        model: the FSDP2 model, sharded inside this group.
        optimizer: its optimizer (healed with it; DiLoCo's inner optimizer).
        tagc_cfg: the TAGC config (None: torchft's fp32 all-reduce, per step).
    """

    def __init__(self, cfg: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                 tagc_cfg: Any) -> None:
        import_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from tagc import ft as tagc_ft
        from tagc import fsdp2

        wait = timedelta(seconds=cfg.timeout)
        self.model, self.optimizer = model, optimizer
        self.iter = 0  # the loop's step, sent to a healing peer
        self.healed_to: Optional[int] = None  # a peer's step, once loaded
        self.pg = ProcessGroupGloo(timeout=wait)
        # init_sync off: every replica builds the same weights from the seed; a late
        # or restarted one heals from a peer whose step is ahead (torchft's rule)
        self.manager = Manager(
            pg=self.pg, min_replica_size=cfg.ft_min_replicas,
            load_state_dict=self._load, state_dict=self._state,
            replica_id=f"tagc_{cfg.ft_replica}", lighthouse_addr=cfg.ft_lighthouse,
            use_async_quorum=False, init_sync=False, timeout=wait, quorum_timeout=wait,
            connect_timeout=wait, **({"hostname": cfg.ft_hostname} if cfg.ft_hostname else {}))
        self.sync: Optional[Any] = None  # TAGC's FTAllReduce
        self.fp32_sent = 0.0
        self.replicas = 1  # the last vote's quorum
        self.committed: Dict[int, int] = {}  # committed steps (syncs) by quorum size
        self.failed = 0  # steps (syncs) not committed
        self.healed = 0  # times this group loaded a peer's state
        self.healed_steps = 0  # the steps those jumps skipped
        # local steps: seconds from a sync's first all-reduce call to its vote's end
        # (per step the exchanges run inside the backward: not timed apart)
        self.sync_s: List[float] = []
        self._sync_t0: Optional[float] = None
        use_tagc = tagc_cfg is not None and cfg.ft_allreduce == "tagc"
        self.local_steps = bool(tagc_cfg is not None and tagc_cfg.outer_every)
        self.diloco: Optional[Any] = None
        self.outer: Optional[Any] = None  # TAGC's FTLocalSteps
        if self.local_steps and use_tagc:
            self.outer = tagc_ft.register(model, tagc_cfg, _Observed(self.manager, self, False),
                                          self.pg, optimizer)
            self.sync = self.outer.ft
            self.vote: Optional[Callable[[], bool]] = None
        elif self.local_steps:
            from torchft.local_sgd import DiLoCo

            outer = torch.optim.SGD(model.parameters(), lr=tagc_cfg.outer_lr,
                                    momentum=tagc_cfg.outer_momentum, nesterov=True)
            # one bucket: one exchange per sync, the whole pseudo-gradient
            self.diloco = DiLoCo(_Observed(self.manager, self, True), [model], optimizer,
                                 outer, sync_every=tagc_cfg.outer_every,
                                 use_bucketization=True,
                                 fragment_sync_delay=tagc_cfg.outer_overlap,
                                 fragment_update_alpha=tagc_cfg.outer_mix)
            self.diloco.__enter__()
            self.vote = None
        elif use_tagc:
            self.sync = tagc_ft.register(model, tagc_cfg, self.manager, self.pg)
            self.vote = self._commit
        else:
            observed = _Observed(self.manager, self, True)
            for _, m, _ in fsdp2._param_groups(model):
                m.set_all_reduce_hook(_PlainHook(observed))
            self.vote = self._commit

    def _state(self) -> Dict[str, Any]:
        return {**local_state(self.model, self.optimizer), "iter": self.iter}

    def _load(self, sd: Dict[str, Any]) -> None:
        load_local_state(self.model, self.optimizer, sd)
        self.healed_to = int(sd["iter"])

    def begin(self, iter_num: int) -> int:
        """Start step ``iter_num``: per step, join its quorum (healing from a peer if
        behind).

        Returns:
            the step to train (a healed group's: its peer's).
        """
        self.iter = iter_num
        if self.local_steps:
            return iter_num  # DiLoCo asks for a quorum at its syncs
        self.manager.start_quorum()
        self.replicas = self.manager.num_participants()
        return self._healed(iter_num, self.manager.current_step())

    def after_step(self, iter_num: int) -> int:
        """The step that follows: ``iter_num``, or after a heal during a sync the
        peer's step that follows."""
        if self.healed_to is None:
            return iter_num
        return self._healed(iter_num, self.healed_to + 1)

    def _healed(self, mine: int, now: int) -> int:
        self.healed_to = None
        if now != mine:
            self.healed += 1
            self.healed_steps += now - mine
            logger.warning("torchft: replica %s healed from a peer: step %d -> %d",
                           self.manager._replica_id, mine, now)
        return now

    def _commit(self) -> bool:
        """Per step: vote on it; with TAGC its feedback state commits or rolls back."""
        ok = (self.sync if self.sync is not None else self.manager).should_commit()
        self.record(ok)
        return ok

    def exchange_started(self) -> None:
        """An all-reduce call: a sync's clock starts at its first."""
        if self.local_steps and self._sync_t0 is None:
            self._sync_t0 = time.perf_counter()

    def record(self, ok: bool) -> None:
        """One vote's outcome (the quorum it was taken in)."""
        if self._sync_t0 is not None:
            self.sync_s.append(time.perf_counter() - self._sync_t0)
            self._sync_t0 = None
        self.replicas = self.manager.num_participants()
        if ok:
            self.committed[self.replicas] = self.committed.get(self.replicas, 0) + 1
        else:
            self.failed += 1
            logger.warning("torchft: step %d not committed (%s); it runs again with the "
                           "next quorum", self.iter, self.manager.errored() or
                           "a peer failed")

    def bytes_between(self) -> float:
        """Bytes this rank sent to other groups so far (TAGC: its counters; fp32: the
        ring all-reduce of every exchange that crossed a link)."""
        return self.sync.wire_bytes if self.sync is not None else self.fp32_sent

    def line(self) -> str:
        """The log line's torchft part."""
        return (f"; torchft: {self.replicas} replicas, {self.bytes_between() / 1e6:.2f} MB "
                f"sent between them, {self.failed} {'syncs' if self.local_steps else 'steps'}"
                f" not committed, healed {self.healed}x")

    def summary(self) -> Dict[str, Any]:
        """The run summary's torchft numbers."""
        return {"ft_bytes_between": self.bytes_between(),
                "ft_bytes_between_fp32": (self.sync.default_wire_bytes
                                          if self.sync is not None else self.fp32_sent),
                "ft_failed": self.failed, "ft_healed": self.healed,
                "ft_healed_steps": self.healed_steps, "ft_replicas": self.replicas,
                "ft_local_steps": self.local_steps,
                "ft_sync_s_mean": self._sync_s_mean(),
                "ft_committed_by_replicas": {str(r): n for r, n in
                                             sorted(self.committed.items())}}

    def checkpoint_state(self) -> Dict[str, Any]:
        """This group's part of a checkpoint (between steps; tagc/train/checkpoint.py
        saves it per rank): the manager's step, TAGC's feedback as of the last commit,
        and the outer loop's anchor, momentum and counters (a sync in flight left
        out: its fragment's next sync sends what it held)."""
        out: Dict[str, Any] = {"manager": self.manager.state_dict()}
        if self.sync is not None:
            out["feedback"] = self.sync.state_dict()
        if self.outer is not None:
            out["outer"] = self.outer.state_dict(committed=True)
        return out

    def resume(self, sd: Dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state`'s output (``--init_from resume``), before the
        first step.  A group that resumes behind a live peer heals from it at its first
        quorum, as a restarted one does.

        Raises:
            ValueError: the checkpoint's mode differs (feedback or local steps).
        """
        for key, have in (("feedback", self.sync), ("outer", self.outer)):
            if (key in sd) != (have is not None):
                raise ValueError(f"--init_from resume: the checkpoint was written "
                                 f"{'with' if key in sd else 'without'} TAGC's "
                                 f"{'feedback' if key == 'feedback' else 'local steps'} "
                                 "between groups, this run is not; resume with its --tagc")
        self.manager.load_state_dict(sd["manager"])
        if self.sync is not None:
            self.sync.load_state_dict(sd["feedback"])
        if self.outer is not None:
            self.outer.load_state_dict(sd["outer"], healed=False)

    def _sync_s_mean(self) -> float:
        times = self.outer.sync_s if self.outer is not None else self.sync_s
        return sum(times) / len(times) if times else float("nan")

    def close(self) -> None:
        """Leave the quorum (the peers go on without this group)."""
        if self.outer is not None:
            self.outer.remove()
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
