"""Local steps on TAGC's HSDP route: DiLoCo's outer step with TAGC's compressed
all-reduce (``outer_every: H``; arXiv 2311.08105), optionally streamed (Streaming
DiLoCo, arXiv 2501.18512: ``outer_fragments``, ``outer_overlap``, ``outer_mix``).

Between nodes the per-step route (tagc/hsdp.py) sends about two coded shards per rank
every step.  With local steps nothing crosses a node for H steps: each node trains with
plain FSDP2 inside itself (no all-reduce hook, so FSDP averages the gradients over the
node's ranks and stops there), the user's optimizer untouched.  The units are split
into P contiguous fragments (P = 1 by default); fragment p is synced at inner steps
``p * H // P + k H`` (k >= 1), counted by a step post-hook on the user's optimizer:

1. **launch** (step t): each rank's pseudo-gradient ``d = start - shard``, the change of
   its shard since the fragment's last sync, goes through the unit's replica reducer:
   the config's compressed all-reduce over the replicate group (two-phase or all-gather
   form, feedback as for gradients), divided by R.  With ``outer_overlap`` tau > 0 this
   runs on a worker thread while the next tau inner steps compute;
2. **merge** (step t + tau): if any entry of the fragment's average is NaN/Inf, every
   replica sees it (all decode the same codes), so all skip the step alike: the
   fragment's shards go back to ``start``, the momentum stays, and a warning says so.
   Otherwise Nesterov momentum, the update torch's ``SGD(nesterov=True)`` takes
   (``m <- mu m + d``, ``global = start - lr (d + mu m)``), ``start <- global``, and the
   shard becomes ``global`` (``outer_mix`` alpha = 0) or ``(1 - alpha) global + alpha
   local`` (Streaming DiLoCo's merge: ``local`` is the replica's shard at t + tau,
   which holds the tau steps taken meanwhile; the replicas then differ by design).
   ``start`` and ``m`` are the same on every replica (the same arithmetic on the same
   decoded average); a checksum of ``start`` over the replicate group (16 bytes per
   unit) checks that at every merge and raises if not.

The outer state is each rank's own: ``start`` and ``m`` (fp32, one shard each), the
inner step count, and while a streamed sync is in flight its average, all on the
unit's reducer beside its feedback state (:meth:`~tagc.hsdp.ReplicaReducer.outer_buffers`),
so ``TAGCState``'s checkpoints, ``memory()`` and :func:`tagc.memory.outer_bytes` carry
them.  A checkpoint taken with a sync in flight first waits for its all-reduce and
saves the average; the merge then happens at its step after a resume.  The inner
optimizer's state is the user's, per replica.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from . import fsdp2
from .hsdp import ReplicaReducer

logger = logging.getLogger(__name__)


def fragments(sizes: List[int], parts: int) -> List[List[int]]:
    """Split units (their shard sizes, in order) into ``parts`` contiguous fragments of
    about equal size: unit i goes to the fragment its size-midpoint falls in.

    Args:
        sizes: elements per unit.
        parts: P >= 1 (at most the number of units; fewer units: one each).
    Returns:
        P' <= P lists of unit indices, none empty, in order.
    """
    total = max(sum(sizes), 1)
    out: List[List[int]] = [[] for _ in range(parts)]
    acc = 0
    for i, s in enumerate(sizes):
        out[min(int((acc + s / 2) * parts / total), parts - 1)].append(i)
        acc += s
    return [f for f in out if f]


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
        self.group = group
        self.replicas = dist.get_world_size(group)
        for u in reducers_:
            u.divide = float(self.replicas)  # the average over the replicas
            u.local = True
        self._setup(mods, reducers_, reducers_[0].cfg, optimizer)

    def _setup(self, mods: List[Any], units: List[Any], cfg: Any,
               optimizer: torch.optim.Optimizer) -> None:
        """What every outer loop shares: the shard check, the fragments and their
        offsets, the common start and the optimizer's step post-hook.

        Args:
            mods: the units' modules.
            units: one holder of the outer state per module (``outer_*``,
                ``shard_numel``, ``device``, ``name``).
            cfg: the config.
            optimizer: the inner optimizer.
        """
        self.mods, self.units, self.cfg = mods, units, cfg
        for m, u in zip(mods, units):
            have = sum(t.numel() for t in self._storage(m))
            if have != u.shard_numel:
                raise ValueError(f"TAGC local steps: unit {u.name!r} holds {have} shard "
                                 f"elements, its reducer {u.shard_numel}")
        self.fragments = fragments([u.shard_numel for u in units], self.cfg.outer_fragments)
        h, p = self.cfg.outer_every, len(self.fragments)
        self.offsets = [i * h // p for i in range(p)]
        self._pool = ThreadPoolExecutor(1, "tagc-outer") if self.cfg.outer_overlap else None
        # a streamed sync in flight: (fragment, step to merge at, its all-reduce)
        self._flight: Optional[Tuple[int, int, Future]] = None
        self._start_identical()
        self._hook = optimizer.register_step_post_hook(self._after_inner_step)

    @staticmethod
    def _storage(mod: Any) -> List[torch.Tensor]:
        """The tensors a unit's shard lives in, in the reducer's layout: an FSDP2
        unit's padded shards of its trained parameters in the unit's order (read
        afresh each time: FSDP2 may re-point ``_sharded_param_data`` after a state
        dict load); a plain module's trained parameters (a replica of one process)."""
        if isinstance(mod, FSDPModule):
            return [fp._sharded_param_data for fp in fsdp2.unit_params(mod)
                    if fp.sharded_param.requires_grad]
        return [p.data for p in mod.parameters() if p.requires_grad]

    def _shard(self, i: int) -> torch.Tensor:
        """Unit i's shard on this rank as one flat fp32 tensor (a copy), on its device."""
        parts = [t.detach().float().reshape(-1) for t in self._storage(self.mods[i])]
        u = self.units[i]
        return torch.cat(parts).to(u.device) if parts else torch.zeros(0, device=u.device)

    def _write(self, i: int, flat: torch.Tensor) -> None:
        """Put ``flat`` (the reducer's layout) into unit i's shard."""
        o = 0
        with torch.no_grad():
            for data in self._storage(self.mods[i]):
                data.copy_(flat[o:o + data.numel()].view_as(data).to(data.dtype))
                o += data.numel()

    def _start_identical(self) -> None:
        """Every replica starts from replica 0's shard (DiLoCo's common start: without
        it the replicas would drift from different points and never agree)."""
        for i, u in enumerate(self.units):
            if u.outer_start is None:
                start = self._shard(i)
                self._common(start)
                self._write(i, start)
                u.outer_start = start
                u.outer_momentum = torch.zeros_like(start)
                # [inner steps since registration, step the sync in flight merges at]
                u.outer_inner = torch.tensor([0, -1], dtype=torch.int64)

    def _common(self, start: torch.Tensor) -> None:
        """Make ``start`` replica 0's, in place."""
        dist.broadcast(start, dist.get_global_rank(self.group, 0), group=self.group)

    # ----------------------------------------------------------------- the schedule
    @property
    def step(self) -> int:
        """Inner steps taken since registration (checkpointed)."""
        return int(self.units[0].outer_inner[0]) if self.units else 0

    @property
    def inner_steps(self) -> int:
        """Inner steps since fragment 0's last sync (the round, unstreamed)."""
        return self.step % self.cfg.outer_every

    def _set_counters(self, step: int, merge_at: int) -> None:
        for u in self.units:
            u.outer_inner.copy_(torch.tensor([step, merge_at]))

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t, merge_at = self.step + 1, int(self.units[0].outer_inner[1])
        self._set_counters(t, merge_at)
        if merge_at == t:  # the sync launched tau steps ago: its outer step now
            self._merge_flight()
        p = self._due(t)
        if p is not None:
            self._launch(p, t)

    def _due(self, t: int) -> Optional[int]:
        """The fragment synced at inner step ``t``, None if none (the offsets are
        distinct: P <= H)."""
        h = self.cfg.outer_every
        for p, off in enumerate(self.offsets):
            if t - off >= h and (t - off) % h == 0:
                return p
        return None

    def _launch(self, p: int, t: int) -> None:
        """Fragment p's pseudo-gradient into its all-reduce; merged at once, or after
        ``outer_overlap`` steps when it runs beside them."""
        idx = self.fragments[p]
        deltas = [self.units[i].outer_start - self._shard(i) for i in idx]
        tau = self.cfg.outer_overlap
        if not tau:
            self._reduce(idx, deltas)
            self._merge(p, deltas)
            return
        self._flight = (p, t + tau, self._pool.submit(self._reduce, idx, deltas))
        self._set_counters(t, t + tau)

    def _reduce(self, idx: List[int], deltas: List[torch.Tensor]) -> None:
        """Each unit's ``d`` replaced by its average over the replicas (compressed);
        on the worker thread with ``outer_overlap``: only it uses the replicate group
        meanwhile (one sync in flight, ``outer_overlap < outer_every // P``)."""
        for i, d in zip(idx, deltas):
            self.units[i].hook(d)
            self.units[i].outer_avg = d

    def _wait_flight(self) -> Optional[int]:
        """Wait for the sync in flight's all-reduce; its fragment, None if none."""
        if self._flight is None:
            return None
        p, _, fut = self._flight
        fut.result()  # re-raises the worker's error
        return p

    def _merge_flight(self) -> None:
        p = self._wait_flight()
        if p is None:  # resumed: the average came from the checkpoint
            p = next(k for k, f in enumerate(self.fragments)
                     if self.units[f[0]].outer_avg is not None)
        self._flight = None
        self._set_counters(self.step, -1)
        self._merge(p, [self.units[i].outer_avg for i in self.fragments[p]])

    def _merge(self, p: int, avgs: List[torch.Tensor]) -> bool:
        """Fragment p's outer step from its averaged pseudo-gradients (module doc)."""
        idx = self.fragments[p]
        new = self._outer(idx, avgs)
        self._check_agree(self._starts(idx, new))
        self._apply(p, new)
        return new is not None

    def _starts(self, idx: List[int], new: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]
                ) -> List[torch.Tensor]:
        """The starts the units ``idx`` have once :meth:`_apply` took ``new`` (None:
        the ones they have)."""
        if new is None:
            return [self.units[i].outer_start for i in idx]
        return [start for _, start in new]

    def _outer(self, idx: List[int], avgs: List[torch.Tensor]
               ) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """Each unit's new (momentum, start) from its average, the state untouched;
        None when an average has a NaN/Inf (every replica decodes the same codes, so
        every replica skips alike)."""
        if not all(bool(torch.isfinite(d).all()) for d in avgs):
            return None
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        out = []
        for i, d in zip(idx, avgs):
            u = self.units[i]
            m = u.outer_momentum.mul(mu).add_(d)
            out.append((m, u.outer_start.sub(d.add(m, alpha=mu), alpha=lr)))
        return out

    def _apply(self, p: int, new: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]
               ) -> None:
        """Fragment p's shards to the new start (merged with the local shard by
        ``outer_mix``); ``new`` None: back to their last sync."""
        alpha = self.cfg.outer_mix
        for k, i in enumerate(self.fragments[p]):
            u = self.units[i]
            u.outer_avg = None
            if new is not None:
                u.outer_momentum.copy_(new[k][0])
                u.outer_start = new[k][1]
            shard = u.outer_start
            if new is not None and alpha:  # global + alpha (local - global)
                shard = shard.add(self._shard(i) - shard, alpha=alpha)
            self._write(i, shard)
        if new is None:
            logger.warning("TAGC local steps: a non-finite pseudo-gradient on some replica; "
                           "the outer step of fragment %d skipped on every replica, its "
                           "shards back at their last sync", p)

    def outer_step(self) -> bool:
        """Sync every fragment now, blocking (every replica must call it at the same
        inner step); a sync in flight is merged first.

        Returns:
            True when every fragment's step was applied, False when a non-finite
            average skipped one (its shards back at their last sync).
        Raises:
            RuntimeError: the replicas' outer state differs after the step.
        """
        if self._flight is not None or any(u.outer_avg is not None for u in self.units):
            self._merge_flight()
        ok = True
        for p, idx in enumerate(self.fragments):
            deltas = [self.units[i].outer_start - self._shard(i) for i in idx]
            self._reduce(idx, deltas)
            ok = self._merge(p, deltas) and ok
        return ok

    def prepare_checkpoint(self) -> None:
        """Before a state dict: a sync in flight finishes its all-reduce, so its
        average (``outer_avg``) is saved and merged at its step after a resume."""
        self._wait_flight()

    def _check_agree(self, starts: List[torch.Tensor]) -> None:
        """Raise when the replicas' ``starts`` differ (a sum and a sum of squares per
        unit, in float64, compared over the replicas)."""
        # on the units' device: NCCL moves no host tensors
        mine = torch.stack([torch.stack((s.double().sum(), s.double().square().sum()))
                            for s in starts])
        everyone = self._gather(mine)
        bad = [i for i, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
        if bad:
            raise RuntimeError(f"TAGC local steps: after an outer step the state of "
                               f"replica(s) {bad} differs from replica 0's; it must agree "
                               "(the same config, data order and codec on every rank?)")

    def _gather(self, mine: torch.Tensor) -> List[torch.Tensor]:
        """Every replica's ``mine``, in replica order."""
        everyone = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(everyone, mine, group=self.group)
        return everyone

    def remove(self) -> None:
        """Stop counting the optimizer's steps; end the worker."""
        self._hook.remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
