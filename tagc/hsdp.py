"""Custom HSDP: FSDP2 shards inside a node, TAGC compresses the all-reduce between nodes.

``tagc.shard_model(model, cfg, mesh=init_device_mesh(dev, (replicas, shards),
mesh_dim_names=("replicate", "shard")))`` shards every unit over the "shard" dimension
only (a 1-D mesh per node: its plain reduce-scatter and all-gathers stay on the fast
links), and ``register`` gives each unit an all-reduce hook
(``FSDPModule.set_all_reduce_hook``): FSDP calls it with the unit's reduce-scatter
output, this rank's shard summed over its node, and the hook sums it over the replicas
(the nodes) in place, compressed.  FSDP then divides by replicas x shards (the hook runs
with SUM reductions forced and that divide factor set), which is native HSDP's average.

Transports of the all-reduce form (every replica must end with the same sum, so every
contribution, this rank's own included, is the compressed one):

* ``dense``: ``dist.all_reduce`` (bit for bit native HSDP with SUM reductions);
* ``quant``: every replica's block-quantized shard to every other (all-gather), each
  decodes and sums them in replica order;
* ``sparse``: every replica's k (offset, value) pairs all-gathered, summed in order;
* ``exact``: the union bitmap (OR all-reduce), a sketch sized from the union bound
  (SUM all-reduce), peeled by every replica alike, and a recovery all-reduce of the
  values at the positions peeling left: lossless;
* ``paper``: the index on ``index_bits`` lanes (SUM all-reduce, carries and all) and a
  fixed ``S/ratio`` sketch (SUM all-reduce), peeled by every replica (LHC's setting).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .config import TAGCConfig
from .device import CodecStreams, Exec
from .reducer import UnitReducer
from .stats import UnitStats
from .transports import _tagc, pairs_wire, require_codec

HSDP_DIMS = ("replicate", "shard")


def check_mesh(mesh: Any) -> None:
    """Refuse a mesh that is not the (replicate, shard) HSDP layout, clearly."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or names != HSDP_DIMS:
        raise ValueError(
            f"shard_model: an HSDP mesh must be 2-D with mesh_dim_names {HSDP_DIMS} "
            f"(init_device_mesh(device, (replicas, shards), mesh_dim_names={HSDP_DIMS})), "
            f"got {mesh.ndim}-D with names {names or None}; a 1-D mesh is plain FSDP")


class ReplicaComm:
    """The collectives over the replicate group, counted in the unit's stats."""

    def __init__(self, group: Any, rank: int, world: int, stats: UnitStats, dev: Exec) -> None:
        self.group, self.rank, self.world, self.stats, self.dev = group, rank, world, stats, dev

    def all_reduce(self, t: torch.Tensor, op: Any = None, control: bool = False) -> None:
        nb = t.numel() * t.element_size()
        self.stats.record("all_reduce", nb, 2.0 * (self.world - 1) / self.world * nb, control)
        self.dev.issue(False, dist.all_reduce, t, op=op or dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every replica's ``inp`` into row r of ``out``."""
        nb = inp.numel() * inp.element_size()
        # a ring all-gather: this rank's message travels to the R-1 others
        self.stats.record("all_gather_into_tensor", nb, (self.world - 1) * nb)
        # gloo wants the output flat (world * numel), not stacked
        self.dev.issue(False, dist.all_gather_into_tensor, out.view(-1), inp, group=self.group)


class ReplicaReducer(UnitReducer):
    """One unit's cross-replica all-reduce (the reducer of a custom-HSDP unit).

    Same identity, feedback state, stats and checkpoint rows as :class:`UnitReducer`;
    ``flat_numel`` is this rank's shard (the reduce-scatter output) and ``world`` the
    number of replicas.  FSDP calls :meth:`hook` with that shard.
    """

    def hook(self, t: torch.Tensor) -> None:
        """FSDP's all-reduce hook: ``t`` (this rank's shard, summed over its node) is
        replaced by its sum over the replicas."""
        if not t.is_cuda:
            self._all_reduce(t)
            return
        with self.streams.around(t):
            self._all_reduce(t)

    @property
    def row_group(self) -> Any:
        # the shards of a node share a replicate rank: checkpoint rows per global rank
        return dist.group.WORLD

    def feedback_buffers(self) -> List[Any]:
        if not self.keeps_feedback:
            return []
        out = [("residual", self.flat_numel, self.cfg.residual_dtype)]
        if self.cfg.ef21:  # every replica's estimate of the sum: one shard long
            out.append(("estimate", self.flat_numel, torch.float32))
        return out

    def _all_reduce(self, t: torch.Tensor) -> None:
        if not t.is_floating_point():
            raise TypeError(f"TAGC: unit {self.name!r} has a non-floating gradient ({t.dtype})")
        flat = t.reshape(-1)
        if flat.numel() != self.flat_numel:
            raise RuntimeError(f"TAGC: unit {self.name!r}: all-reduce input of {flat.numel()} "
                               f"elements, expected {self.flat_numel} (every parameter of a "
                               "compressed unit must get a gradient each step)")
        dev = Exec(flat)
        comm = ReplicaComm(self.group, self.rank, self.world, self.stats, dev)
        nb = flat.numel() * flat.element_size()
        self.stats.add("calls", 1)
        self.stats.add("default_wire_bytes", 2.0 * (self.world - 1) / self.world * nb)
        if not self.compressed or self.world == 1 or flat.numel() == 0 \
                or self.cfg.theta_at(self.step) is None:
            self._plain_all_reduce(comm, flat)
            if self.compressed and self.world > 1 and self.cfg.theta_at(self.step) is None:
                self.stats.add("dense_step_calls", 1)
                self.step += 1
            return
        if self.cfg.mode != "dense":
            require_codec()
        # guard_ratio is 0 here (reducers() below): "compress" or "plain"
        if self._agree(comm, flat) == "plain":
            self._plain_all_reduce(comm, flat)
            return
        if self.keeps_feedback and self.residual is None:
            self.residual = torch.zeros(self.flat_numel, dtype=self.cfg.residual_dtype,
                                        device=flat.device)
        self._apply_damping()
        acc = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        REPLICA_TRANSPORTS[self.cfg.mode](self, comm, flat, acc)
        if self.cfg.ef21 and self.cfg.mode != "dense":
            self._ef21_update(dev, flat, acc)
        self.step += 1
        t.copy_(acc.view_as(t))

    def _plain_all_reduce(self, comm: ReplicaComm, flat: torch.Tensor) -> None:
        self.stats.add("plain_calls", 1)
        if self.world > 1:
            comm.all_reduce(flat)

    def shards_in(self, inp: torch.Tensor) -> int:
        return 1  # an all-reduce input: this rank's one shard

    def k(self, s: int) -> int:
        return self.cfg.kept(self.step, s)


def _dense(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, acc: torch.Tensor) -> None:
    comm.all_reduce(g)
    acc.copy_(g)


def _quant(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, acc: torch.Tensor) -> None:
    fmt, block, kw = r.cfg.quant_format, r.cfg.quant_block, comm.dev.kw
    nb = _tagc.quant_bytes(g.numel(), fmt, block)
    mine = torch.empty(nb, dtype=torch.uint8, device=g.device)
    _tagc.quant_encode(mine, r.residual, g, fmt, block, **kw)
    every = torch.empty(comm.world, nb, dtype=torch.uint8, device=g.device)
    comm.all_gather(every, mine)
    for i in range(comm.world):  # replica order: the same sum on every replica
        _tagc.quant_decode_add(acc, every[i], fmt, block, **kw)
    r.stats.add("union_size", g.numel(), comm.dev.ok)
    r.stats.add("shard_slots", g.numel(), comm.dev.ok)


def _select(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, k: int,
            vd: Optional[torch.dtype] = None) -> List[torch.Tensor]:
    """This replica's top-k of its shard with error feedback: idx, val (of ``vd``,
    default the config's value dtype), bitmap."""
    n, kw = g.numel(), dict(comm.dev.kw)
    idx = torch.empty(k, dtype=torch.int32, device=g.device)
    val = torch.empty(k, dtype=vd or r.cfg.value_dtype, device=g.device)
    bm = torch.empty(_tagc.bitmap_bytes(n), dtype=torch.uint8, device=g.device)
    if comm.dev.cuda:
        kw["out"] = torch.empty(1, dtype=torch.float32, device=g.device)
    _tagc.sparsify(idx, val, bm, r.residual, g, k, **kw)
    return [idx, val, bm]


def _pairs(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, acc: torch.Tensor) -> None:
    """``sparse`` and ``auto``: every replica's k pairs of the shard to every replica
    (one all-gather of messages whose size every replica knows), added in replica
    order."""
    k = r.k(g.numel())
    wire = pairs_wire(r.cfg, g.numel(), k, g.dtype, comm.dev.kw)
    idx, val, _ = _select(r, comm, g, k, wire.value_dtype)
    mine = torch.empty(wire.nbytes, dtype=torch.uint8, device=g.device)
    wire.pack(mine, idx, val)
    every = torch.empty(comm.world, wire.nbytes, dtype=torch.uint8, device=g.device)
    comm.all_gather(every, mine)
    for i in range(comm.world):
        wire.unpack(acc, every[i])
    r.stats.add("shard_slots", g.numel(), comm.dev.ok)
    if wire.coding is not None:
        r.stats.add("coded_" + wire.coding, 1, comm.dev.ok)


def _peel_all(r: ReplicaReducer, comm: ReplicaComm, acc: torch.Tensor, sk: torch.Tensor,
              union: torch.Tensor, t: int, seed: int, estimate: bool
              ) -> Any:
    """Every replica peels the same summed sketch: the same values everywhere."""
    n = acc.numel()
    usize = comm.dev.count(_tagc.popcount, union, n)
    r.stats.add("union_size", usize, comm.dev.ok)
    r.stats.add("shard_slots", n, comm.dev.ok)
    if comm.dev.cuda or estimate:
        cnt = comm.dev.count(_tagc.peel_decode, acc, sk.float(), union, n, t, seed,
                             estimate=True, out_kw="count_out")
        r.stats.add("unpeeled", cnt, comm.dev.ok)
        if not isinstance(cnt, torch.Tensor) and cnt:
            r._warn_unpeeled(cnt, int(usize), "estimated (median of their buckets)")
        return None
    unpeeled = torch.empty(max(int(usize), 1), dtype=torch.int32, device=acc.device)
    cnt = comm.dev.count(_tagc.peel_decode, acc, sk.float(), union, n, t, seed,
                         unpeeled=unpeeled, estimate=False, out_kw="count_out")
    return unpeeled[:cnt]


def _exact(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, acc: torch.Tensor) -> None:
    n, kw, world = g.numel(), comm.dev.kw, comm.world
    k = r.k(n)
    idx, val, bm = _select(r, comm, g, k)
    comm.all_reduce(bm, op=dist.ReduceOp.BOR)  # the union, a true OR
    m = math.ceil(r.cfg.sketch_factor * min(n, world * k))
    t = max(1, math.ceil(m / 3))
    seed = _tagc.seed_derive(r.cfg.seed, r.index, r.step)
    sk = torch.empty(_tagc.sketch_buckets(t), dtype=r.cfg.value_dtype, device=g.device)
    _tagc.sketch_encode(sk, idx, val, n, t, seed, **kw)
    comm.all_reduce(sk)
    left = _peel_all(r, comm, acc, sk, bm, t, seed, estimate=False)
    if left is None or left.numel() == 0:
        return
    # What peeling left is the same everywhere: every replica adds its kept value
    # there (0 if not kept) and one SUM all-reduce gives the exact sums.
    cnt = left.numel()
    r.stats.add("unpeeled", cnt)
    r.stats.add("recovered", cnt)
    r._warn_unpeeled(cnt, cnt, "recovered by a second all-reduce")
    pos, kept = left.long(), idx.long()
    j = torch.searchsorted(kept, pos).clamp_(max=k - 1)
    mine = torch.where(kept[j] == pos, val[j].float(), torch.zeros(cnt, device=g.device))
    comm.all_reduce(mine)
    acc[pos] = mine


def _paper(r: ReplicaReducer, comm: ReplicaComm, g: torch.Tensor, acc: torch.Tensor) -> None:
    n, kw, bits = g.numel(), comm.dev.kw, r.cfg.index_bits
    k = r.k(n)
    idx, val, bm = _select(r, comm, g, k)
    lanes = torch.empty(_tagc.lanes_bytes(n, bits), dtype=torch.uint8, device=g.device)
    _tagc.lanes_pack(lanes, bm, n, bits, **kw)
    comm.all_reduce(lanes)  # SUM: carries and all, as the paper's index
    t = max(1, math.ceil(math.ceil(n / r.cfg.ratio) / 3))
    seed = _tagc.seed_derive(r.cfg.seed, r.index, r.step)
    sk = torch.empty(_tagc.sketch_buckets(t), dtype=r.cfg.value_dtype, device=g.device)
    _tagc.sketch_encode(sk, idx, val, n, t, seed, **kw)
    comm.all_reduce(sk)
    union = torch.empty_like(bm)
    _tagc.lanes_unpack(union, lanes, n, bits, **kw)
    _peel_all(r, comm, acc, sk, union, t, seed, estimate=True)


REPLICA_TRANSPORTS: Dict[str, Callable[..., None]] = {
    "dense": _dense, "quant": _quant, "sparse": _pairs, "auto": _pairs, "exact": _exact,
    "paper": _paper}


def reducers(model: Any, cfg: TAGCConfig, mesh: Any, streams: CodecStreams,
             base: List[UnitReducer]) -> List[ReplicaReducer]:
    """One ReplicaReducer per unit of the FSDP2 glue's reducers (same identity)."""
    if cfg.bypass_every:
        raise NotImplementedError("bypass_every: the automatic bypass is not implemented "
                                  "for HSDP's cross-replica all-reduce; set bypass_every=0")
    if cfg.guard_ratio:
        raise NotImplementedError("guard_ratio: the feedback guard is not implemented for "
                                  "HSDP's cross-replica all-reduce; set guard_ratio=0 (or "
                                  "leave it None: off with HSDP)")
    group = mesh.get_group("replicate")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for u in base:
        # the all-reduce's input is this rank's shard of the FSDP2 unit
        spec = dataclasses.replace(u.spec, flat_numel=u.flat_numel // u.world)
        out.append(ReplicaReducer(cfg, spec, group, rank, world, 1.0, 1.0, streams))
        out[-1].guard_ratio = 0.0  # the default guard is FSDP1/FSDP2's only
    return out


def install(mods: List[Any], reducers_: List[ReplicaReducer], shards: int) -> None:
    """The hook on every unit; SUM reductions and one divide by replicas x shards."""
    for m, r in zip(mods, reducers_):
        m.set_all_reduce_hook(lambda t, r=r: r.hook(t))  # looked up per call
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(float(r.world * shards))

