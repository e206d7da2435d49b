"""The training script's torchft mode (``--ft_lighthouse``): this torchrun job is one
replica group of a torchft run (docs/TORCHFT.md).

Inside the group FSDP2 shards the model as usual; between groups a ``torchft.Manager``
forms a quorum every step, and each unit's gradient shard is averaged over it by TAGC's
:func:`tagc.ft.register` (``--tagc``) or by torchft's own ``Manager.allreduce`` (plain,
fp32).  A step whose exchange failed (a peer died) is not committed: the optimizer does
not step, TAGC's feedback state rolls back, and the step runs again with the next
quorum.  A group that starts late or restarts heals from a live peer through torchft's
recovery: the model, the optimizer and the step (:func:`local_state`).
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Dict, Optional

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
        ``{"model": name -> tensor, "optim": optimizer state dict with local tensors}``.
    """
    osd = optimizer.state_dict()
    return {"model": {k: _local(v).detach() for k, v in model.state_dict().items()},
            "optim": {"state": {i: {k: _local(v) for k, v in s.items()}
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


class _PlainHook:
    """A unit's all-reduce hook through torchft's own ``Manager.allreduce`` (fp32;
    torchft reports a failure to the manager itself)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def __call__(self, t: torch.Tensor) -> None:
        self.manager.allreduce(t).wait()


class ReplicaGroup:
    """This torchrun job as one replica group: the manager, the group between
    replicas, the gradient hooks, the commit, and the bytes between replicas.

    Args:
        cfg: the run config (``ft_lighthouse``, ``ft_replica``, ``ft_min_replicas``,
            ``timeout``).
        model: the FSDP2 model, sharded inside this group.
        optimizer: its optimizer (healed with it).
        tagc_cfg: the TAGC config (None: torchft's plain all-reduce).
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
        self.pg = ProcessGroupGloo(timeout=wait)
        # init_sync off: every replica builds the same weights from the seed; a late
        # or restarted one heals from a peer whose step is ahead (torchft's rule)
        self.manager = Manager(
            pg=self.pg, min_replica_size=cfg.ft_min_replicas,
            load_state_dict=lambda sd: load_local_state(model, optimizer, sd),
            state_dict=lambda: local_state(model, optimizer),
            replica_id=f"tagc_{cfg.ft_replica}", lighthouse_addr=cfg.ft_lighthouse,
            use_async_quorum=False, init_sync=False, timeout=wait, quorum_timeout=wait,
            connect_timeout=wait)
        self.sync: Optional[Any] = None
        self._plain_sent = 0.0
        if tagc_cfg is not None:
            self.sync = tagc_ft.register(model, tagc_cfg, self.manager, self.pg)
        else:
            self._numel = 0
            for _, m, pgroup in fsdp2._param_groups(model):
                m.set_all_reduce_hook(_PlainHook(self.manager))
                self._numel += sum(int(fp.padded_sharded_param_size.numel())
                                   for fp in pgroup.fsdp_params
                                   if fp.sharded_param.requires_grad)
        self.replicas = 1  # the last step's quorum
        self.committed: Dict[int, int] = {}  # committed steps by quorum size
        self.failed = 0  # steps not committed
        self.healed = 0  # times this group loaded a peer's state
        self.healed_steps = 0  # the steps those jumps skipped

    def begin(self) -> int:
        """Join this step's quorum (healing from a peer if behind).

        Returns:
            the step to train: the manager's committed steps.
        """
        before = self.manager.current_step()
        self.manager.start_quorum()
        step = self.manager.current_step()
        self.replicas = self.manager.num_participants()
        if step != before:
            self.healed += 1
            self.healed_steps += step - before
            logger.warning("torchft: replica %s healed from a peer: step %d -> %d",
                           self.manager._replica_id, before, step)
        return step

    def commit(self) -> bool:
        """Vote on the step; with TAGC its feedback state commits or rolls back too.

        Returns:
            whether every participant's exchange succeeded (then step the optimizer).
        """
        if self.sync is not None:
            ok = self.sync.should_commit()
        else:
            ok = self.manager.should_commit()
            if ok and self.replicas > 1:
                # the fp32 ring all-reduce torchft's gloo group runs, per rank
                self._plain_sent += 4 * self._numel * 2 * (self.replicas - 1) / self.replicas
        if ok:
            self.committed[self.replicas] = self.committed.get(self.replicas, 0) + 1
        else:
            self.failed += 1
            logger.warning("torchft: step %d not committed (%s); it runs again with the "
                           "next quorum", self.manager.current_step(),
                           self.manager.errored() or "a peer failed")
        return ok

    def bytes_between(self) -> float:
        """Bytes this rank sent to other replicas so far (TAGC: its counters; plain:
        the ring all-reduce of every committed synced step)."""
        return self.sync.wire_bytes if self.sync is not None else self._plain_sent

    def line(self) -> str:
        """The log line's torchft part."""
        return (f"; torchft: {self.replicas} replicas, {self.bytes_between() / 1e6:.2f} MB "
                f"sent between them, {self.failed} steps not committed, healed "
                f"{self.healed}x")

    def summary(self) -> Dict[str, Any]:
        """The run summary's torchft numbers."""
        return {"ft_bytes_between": self.bytes_between(),
                "ft_bytes_between_fp32": (self.sync.default_wire_bytes
                                          if self.sync is not None else self._plain_sent),
                "ft_failed_steps": self.failed, "ft_healed": self.healed,
                "ft_healed_steps": self.healed_steps,
                "ft_replicas": self.replicas,
                "ft_committed_by_replicas": {str(r): n for r, n in
                                             sorted(self.committed.items())}}

    def close(self) -> None:
        """Leave the quorum (the peers go on without this group)."""
        self.manager.shutdown(wait=False)

