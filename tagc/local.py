"""Local steps on TAGC's HSDP route: DiLoCo's outer step with TAGC's compressed
all-reduce (``outer_every: H``; arXiv 2311.08105).

Between nodes the per-step route (tagc/hsdp.py) sends about two coded shards per rank
every step.  With local steps nothing crosses a node for H steps: each node trains with
plain FSDP2 inside itself (no all-reduce hook, so FSDP averages the gradients over the
node's ranks and stops there), the user's optimizer untouched.  Every H-th
``optimizer.step()`` then ends a round (:meth:`LocalSteps.outer_step`):

1. each rank's pseudo-gradient ``d = start - shard``, the change of its shard since the
   round began, goes through the unit's replica reducer: the config's compressed
   all-reduce over the replicate group (two-phase or all-gather form, feedback as for
   gradients), divided by R;
2. if any entry of any unit's average is NaN/Inf, every replica sees it (all decode the
   same codes), so all skip the step alike: each rank's shard goes back to ``start``,
   the momentum stays, and a warning says so;
3. otherwise Nesterov momentum, the update torch's ``SGD(nesterov=True)`` takes
   (``m <- mu m + d``, ``shard <- start - lr (d + mu m)``), moves ``start`` and writes it
   into the shard.  Every replica applies the same arithmetic to the same ``start``,
   ``m`` and decoded average, so the replicas end the round bit-identical; a checksum
   over the replicate group (16 bytes per unit) checks that every round.

The outer state is each rank's own: ``start`` and ``m`` (fp32, one shard each) and the
round's step count live on the unit's reducer beside its feedback state
(:meth:`~tagc.hsdp.ReplicaReducer.feedback_buffers`), so ``TAGCState``'s checkpoints,
``stats()["memory"]`` and the memory formulas carry them.  The inner optimizer's state
is the user's, per replica.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch
import torch.distributed as dist

from . import fsdp2
from .hsdp import ReplicaReducer

logger = logging.getLogger(__name__)


class LocalSteps:
    """The outer loop of local-step training over a model's replica reducers.

    Args:
        mods: the FSDP2 units, in the reducers' order.
        reducers_: one replica reducer per unit (:func:`tagc.hsdp.reducers`).
        group: the replicate process group.
        optimizer: the user's (inner) optimizer; a step post-hook counts its steps.
    Raises:
        ValueError: a unit whose parameters do not fill its reducer's shard.
    """

    def __init__(self, mods: List[Any], reducers_: List[ReplicaReducer], group: Any,
                 optimizer: torch.optim.Optimizer) -> None:
        self.mods, self.units, self.group = mods, reducers_, group
        self.cfg = reducers_[0].cfg
        self.replicas = dist.get_world_size(group)
        for m, u in zip(mods, reducers_):
            u.divide = float(self.replicas)  # the average over the replicas
            u.local = True
            have = sum(fp._sharded_param_data.numel() for fp in self._params(m))
            if have != u.shard_numel:
                raise ValueError(f"TAGC local steps: unit {u.name!r} holds {have} shard "
                                 f"elements, its reducer {u.shard_numel}")
        self._start_identical()
        self._hook = optimizer.register_step_post_hook(self._after_inner_step)

    @staticmethod
    def _params(mod: Any) -> List[Any]:
        # the reducer's layout (tagc/fsdp2.py reducers): padded shards of the trained
        # parameters, in the unit's order; read afresh each time, since FSDP2 may
        # re-point _sharded_param_data (reset_sharded_param, after a state dict load)
        return [fp for fp in fsdp2.unit_params(mod) if fp.sharded_param.requires_grad]

    def _shard(self, mod: Any) -> torch.Tensor:
        """This rank's shard of a unit as one flat fp32 tensor (a copy)."""
        parts = [fp._sharded_param_data.detach().float() for fp in self._params(mod)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _write(self, mod: Any, flat: torch.Tensor) -> None:
        """Put ``flat`` (the reducer's layout) into the unit's shard."""
        o = 0
        with torch.no_grad():
            for fp in self._params(mod):
                data = fp._sharded_param_data
                data.copy_(flat[o:o + data.numel()].to(data.dtype))
                o += data.numel()

    def _start_identical(self) -> None:
        """Every replica starts from replica 0's shard (DiLoCo's common start: without
        it the replicas would drift from different points and never agree)."""
        src = dist.get_global_rank(self.group, 0)
        for m, u in zip(self.mods, self.units):
            if u.outer_start is None:
                start = self._shard(m).to(u.device)
                dist.broadcast(start, src, group=self.group)
                self._write(m, start)
                u.outer_start = start
                u.outer_momentum = torch.zeros_like(start)
                u.outer_inner = torch.zeros(1, dtype=torch.int64)

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        counter = self.units[0].outer_inner
        counter += 1
        for u in self.units[1:]:
            u.outer_inner.copy_(counter)
        if int(counter) >= self.cfg.outer_every:
            self.outer_step()

    @property
    def inner_steps(self) -> int:
        """Inner steps taken in the current round."""
        return int(self.units[0].outer_inner) if self.units else 0

    def outer_step(self) -> bool:
        """End the round now (every replica must call it at the same inner step).

        Returns:
            True when the step was applied, False when a non-finite average skipped
            it (every shard back at the round's start).
        Raises:
            RuntimeError: the replicas' shards differ after the step (they must agree).
        """
        for u in self.units:
            u.outer_inner.zero_()
        deltas = []
        for m, u in zip(self.mods, self.units):
            d = u.outer_start - self._shard(m).to(u.device)
            u.hook(d)  # in place: the average over the replicas, compressed
            deltas.append(d)
        finite = all(bool(torch.isfinite(d).all()) for d in deltas)
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for m, u, d in zip(self.mods, self.units, deltas):
            if finite:
                u.outer_momentum.mul_(mu).add_(d)
                u.outer_start = u.outer_start.sub(d.add(u.outer_momentum, alpha=mu),
                                                  alpha=lr)
            self._write(m, u.outer_start)
        if not finite:
            logger.warning("TAGC local steps: a non-finite pseudo-gradient on some replica; "
                           "outer step %d skipped on every replica, every shard back at the "
                           "round's start", self.units[0].step)
        self._check_agree()
        return finite

    def _check_agree(self) -> None:
        """Raise when the replicas' shards differ (a sum and a sum of squares per
        unit, in float64, compared over the replicate group)."""
        # on the units' device: NCCL moves no host tensors
        mine = torch.stack([torch.stack((u.outer_start.double().sum(),
                                         u.outer_start.double().square().sum()))
                            for u in self.units])
        everyone = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(everyone, mine, group=self.group)
        bad = [i for i, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
        if bad:
            raise RuntimeError(f"TAGC local steps: after outer step {self.units[0].step} the "
                               f"shards of replica(s) {bad} differ from replica 0's; they must "
                               "agree (the same config, data order and codec on every rank?)")

    def remove(self) -> None:
        """Stop counting the optimizer's steps."""
        self._hook.remove()
