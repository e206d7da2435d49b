"""The collectives of one reduction: every tensor handed to ``torch.distributed``
passes here, so ``stats()`` counts exactly what was sent (and what an ideal network
would carry: all-to-all minus the own chunk, ring all-reduce 2(N-1)/N, ring all-gather
N-1 times the own message, reduce unless the destination, reduce-scatter (N-1)/N, isend
all of it).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .device import Exec
from .stats import UnitStats


def exchanges_pairwise(group: Any, world: int, t: torch.Tensor) -> bool:
    """Whether an all-gather over ``group`` goes as one exchange with the peer
    (:func:`pair_all_gather`) instead of gloo's all-gather.

    Two CPU ranks on gloo only: there ``all_gather_into_tensor`` reached 68% of a
    200 Mbit/s link and 45-60% of the loopback's rate in
    ``scripts/bench/bench_collectives.py`` (docs/RESULTS.md), while an isend/irecv pair
    moves the same bytes at the link's rate.  From three ranks on, gloo's ring
    all-gather ran at the link's rate and the exchange with every peer below it, so
    the all-gather stays.  The same on every rank: it depends on the group only.
    """
    return world == 2 and t.device.type == "cpu" and dist.get_backend(group) == "gloo"


def pair_all_gather(out: torch.Tensor, inp: torch.Tensor, rank: int, group: Any) -> None:
    """All-gather over two ranks as one exchange: row ``rank`` of ``out`` (2 rows) gets
    ``inp`` (no copy when ``inp`` is that row, as FSDP2 hands it), the other row the
    peer's.  Synchronous; the receive is posted before the send.

    Args:
        out: 2 equal contiguous rows (any shape whose first dim is 2, or flat).
        inp: this rank's row.
        rank: this rank in ``group`` (0 or 1).
        group: the two ranks' process group.
    """
    if out.numel() == 0:
        return
    rows = out.view(2, -1)
    mine, peer = rows[rank], rows[1 - rank]
    src = inp.reshape(-1)
    if src.data_ptr() != mine.data_ptr():
        mine.copy_(src)
    works = [dist.irecv(peer, group=group, group_src=1 - rank),
             dist.isend(mine, group=group, group_dst=1 - rank)]
    for w in works:
        w.wait()


def flat_all_gather() -> Tuple[str, Callable[..., Any]]:
    """The backend's all-gather into one flat tensor, with its name (what the stats
    count): ``all_gather_single`` from torch 2.13, ``all_gather_into_tensor`` (since
    deprecated) before."""
    if hasattr(dist, "all_gather_single"):
        return "all_gather_single", dist.all_gather_single
    return "all_gather_into_tensor", dist.all_gather_into_tensor  # pragma: no cover


class Comm:
    """Collectives of one call over the unit's process group.

    Args:
        group: the unit's process group (None: the default group).
        rank: this rank in ``group``.
        world: ranks in ``group`` (N).
        stats: the unit's counters.
        dev: the call's device side (CPU: synchronous; CUDA: async, stream waits).
    """

    def __init__(self, group: Any, rank: int, world: int, stats: UnitStats, dev: Exec) -> None:
        self.group, self.rank, self.world, self.stats, self.dev = group, rank, world, stats, dev

    @property
    def staged(self) -> bool:
        """Whether this call's messages are CUDA tensors on a gloo group: ranks that
        share one GPU, which NCCL refuses.  gloo has no CUDA send/recv (it would hand a
        device address to its transport), so the messages of one exchange go as one
        all-to-all (:class:`StagedExchange`), which gloo stages through pinned host
        memory on its own thread: ordered after the current (codec) stream's work, and
        before that stream's later work once waited for."""
        return self.dev.cuda and dist.get_backend(self.group) == "gloo"

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   in_splits: Optional[List[int]] = None,
                   out_splits: Optional[List[int]] = None,
                   async_op: bool = False, control: bool = False) -> Any:
        """``dist.all_to_all_single`` (rows of ``inp`` to their owners)."""
        rows = inp.shape[0] if inp.dim() > 0 else 0
        if in_splits is None:
            own = inp.numel() // self.world if self.world else 0
        else:
            per_row = inp.numel() // max(rows, 1) if inp.dim() > 0 else 0
            own = in_splits[self.rank] * per_row
        wire = (inp.numel() - own) * inp.element_size()
        self.stats.record("all_to_all_single", inp.numel() * inp.element_size(), wire, control)
        return self.dev.issue(async_op, dist.all_to_all_single, out, inp,
                              output_split_sizes=out_splits, input_split_sizes=in_splits,
                              group=self.group)

    def all_reduce(self, t: torch.Tensor, async_op: bool = False,
                   control: bool = False) -> Any:
        """SUM all-reduce of ``t`` in place."""
        nb = t.numel() * t.element_size()
        self.stats.record("all_reduce", nb, 2.0 * (self.world - 1) / self.world * nb, control)
        return self.dev.issue(async_op, dist.all_reduce, t, op=dist.ReduceOp.SUM,
                              group=self.group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's ``inp`` into row r of ``out`` (a ring all-gather: this rank's
        message travels to the N-1 others)."""
        nb = inp.numel() * inp.element_size()
        if exchanges_pairwise(self.group, self.world, inp):
            self.stats.record("pair_all_gather", nb, nb)
            pair_all_gather(out, inp, self.rank, self.group)
            return
        # gloo wants the output flat (world * numel), not stacked
        name, gather = flat_all_gather()
        self.stats.record(name, nb, (self.world - 1) * nb)
        self.dev.issue(False, gather, out.view(-1), inp, group=self.group)

    def reduce(self, t: torch.Tensor, dst_group_rank: int, async_op: bool = False) -> Any:
        """SUM reduce of ``t`` to group rank ``dst_group_rank``."""
        nb = t.numel() * t.element_size()
        self.stats.record("reduce", nb, 0 if dst_group_rank == self.rank else nb)
        dst = dist.get_global_rank(self.group, dst_group_rank) if self.group is not None \
            else dst_group_rank
        return self.dev.issue(async_op, dist.reduce, t, dst=dst, op=dist.ReduceOp.SUM,
                              group=self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """The plain SUM reduce-scatter (what FSDP's default path does)."""
        nb = inp.numel() * inp.element_size()
        wire = (self.world - 1) / self.world * nb
        if hasattr(dist, "reduce_scatter_single"):  # reduce_scatter_tensor is deprecated
            self.stats.record("reduce_scatter_single", nb, wire)
            self.dev.issue(False, dist.reduce_scatter_single, out, inp,
                           op=dist.ReduceOp.SUM, group=self.group)
        else:  # pragma: no cover - older torch
            self.stats.record("reduce_scatter_tensor", nb, wire)
            self.dev.issue(False, dist.reduce_scatter_tensor, out, inp,
                           op=dist.ReduceOp.SUM, group=self.group)

    # -- point to point: a message per owner, its size known up front
    def ring(self) -> List[int]:
        """Owners in ring order from ``rank + 1``: at each step the ranks target
        different owners; the own shard comes last and stays local."""
        return [(self.rank + 1 + i) % self.world for i in range(self.world)]

    def stepped(self) -> bool:
        """Whether the messages go one ring step at a time (CPU, three ranks or more).

        On gloo, R - 1 peers sending to one rank at once share its link badly: an
        exchange with every peer posted at once reached 85% of the 200 Mbit/s link at
        R = 4, the same exchange in ring steps (send to rank + i, receive from
        rank - i, both done before step i + 1) 98-100%
        (``scripts/bench/bench_collectives.py`` ``p2p`` and ``p2p_ring``; docs/RESULTS.md).
        With two ranks there is one peer: nothing to step.
        """
        return not self.dev.cuda and self.world >= 3

    def post_recvs(self, recv: torch.Tensor) -> List[Any]:
        """Receives of row ``r`` of ``recv`` from every other rank ``r`` (CPU with two
        ranks; stepped (:meth:`stepped`) and on CUDA each receive goes with a send in
        :meth:`post_send`)."""
        if self.dev.cuda or self.stepped():
            return []
        out = []
        for r in range(self.world):
            if r != self.rank:
                nb = recv[r].numel() * recv[r].element_size()
                self.stats.record("irecv", nb, 0)
                out.append(dist.irecv(recv[r], group=self.group, group_src=r))
        return out

    def post_send(self, works: List[Any], buf: torch.Tensor, recv: torch.Tensor,
                  r: int) -> None:
        """Send row ``r`` of ``buf`` (shard r's message) to its owner ``r``.

        Every message size is known up front, so the receives are posted first
        (:meth:`post_recvs`) and shard ``r`` goes out while shard ``r+1`` is
        encoded.  Stepped (:meth:`stepped`): the previous step's send and receive
        are waited for, then this step's pair is posted; shard ``r`` was encoded
        while the previous step travelled.
        """
        nb = buf[r].numel() * buf[r].element_size()
        # at ring step i this rank sends to rank+1+i and hears from rank-1-i
        src = (2 * self.rank - r) % self.world
        if self.stepped():
            self.wait(works)
            works.clear()
            self.stats.record("irecv", nb, 0)
            works.append(dist.irecv(recv[src], group=self.group, group_src=src))
            self.stats.record("isend", nb, nb)
            works.append(dist.isend(buf[r], group=self.group, group_dst=r))
            return
        if not self.dev.cuda:
            self.stats.record("isend", nb, nb)
            works.append(dist.isend(buf[r], group=self.group, group_dst=r))
            return
        if self.staged:
            if not any(isinstance(w, StagedExchange) for w in works):
                works.append(StagedExchange(self, buf, recv))
            return
        # NCCL: a lone recv ahead of a lone send deadlocks between two ranks,
        # so each send is batched with the ring-symmetric receive
        self.stats.record("isend", nb, nb)
        self.stats.record("irecv", nb, 0)
        c10d = dist.distributed_c10d
        works.extend(dist.batch_isend_irecv([
            dist.P2POp(c10d.isend, buf[r], group=self.group, group_peer=r),
            dist.P2POp(c10d.irecv, recv[src], group=self.group, group_peer=src)]))

    @staticmethod
    def wait(works: List[Any]) -> None:
        """Wait for posted work (on CUDA with the codec stream current: a stream wait)."""
        for w in works:
            w.wait()


class StagedExchange:
    """One exchange's messages over gloo on CUDA (:attr:`Comm.staged`): row r of ``buf``
    to owner r, row r of ``recv`` from rank r, as one ``all_to_all_single`` issued when
    waited for, once every row is written (the transports encode a row, post it, encode
    the next).  The own row travels to itself (the rows are equal in size) and is not
    read.

    Args:
        comm: the call's collectives.
        buf: (N, bytes) messages, row r for owner r.
        recv: (N, bytes) receives.
    """

    def __init__(self, comm: Comm, buf: torch.Tensor, recv: torch.Tensor) -> None:
        self.comm, self.buf, self.recv = comm, buf, recv
        self.done = False

    def wait(self) -> None:
        """Issue the all-to-all and order the current stream after it (on gloo a host
        wait for its thread, not a device synchronisation)."""
        if not self.done:
            self.done = True
            self.comm.all_to_all(self.recv, self.buf)
