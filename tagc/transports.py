"""Transports: how one compressed reduction crosses the network (docs/DESIGN.md section 4).

Every transport has the same signature, ``transport(call, inp, acc)``: ``inp`` is the
unit's flat gradient (N shards of S), ``acc`` (S, fp32) receives what every rank sent
for this rank's shard, summed (the caller divides).  They sit in :data:`TRANSPORTS`,
keyed by mode.  All codec work is ``_tagc``'s; a transport moves buffers and counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import codec
from .codec import _tagc
from .comm import Comm
from .config import TAGCConfig
from .device import Exec, gate
from .stats import UnitStats

@dataclass
class Call:
    """One compressed reduction of one unit, as a transport sees it.

    Attributes:
        cfg: the config.
        index: the unit's position among the model's units (hash seeds).
        step: the unit's reduction number (warm-up schedule, hash seeds).
        residual: this rank's feedback buffer for the whole unit (None: no
            error feedback); shard r is ``residual[r*S:(r+1)*S]``.
        comm: the collectives (and the counters they feed).
        dev: the device side (stream keywords, device counts, the finite flag).
        stats: the unit's counters.
        warn_unpeeled: logs (once per unit) that peeling left entries (count,
            union size, what happened to them).
    """

    cfg: TAGCConfig
    index: int
    step: int
    residual: Optional[torch.Tensor]
    comm: Comm
    dev: Exec
    stats: UnitStats
    warn_unpeeled: Callable[[int, int, str], None]

    @property
    def world(self) -> int:
        return self.comm.world

    @property
    def rank(self) -> int:
        return self.comm.rank

    def k(self, s: int) -> int:
        """Entries kept per shard of ``s`` at this step (warm-up schedule)."""
        return self.cfg.kept(self.step, s)

    def seed(self) -> int:
        """Sketch hash seed of this call: the same on every rank, new every step."""
        return _tagc.seed_derive(self.cfg.seed, self.index, self.step)

    def res(self, r: int, s: int) -> Optional[torch.Tensor]:
        """This rank's feedback for shard ``r`` (None without error feedback)."""
        return None if self.residual is None else self.residual[r * s:(r + 1) * s]

    def add(self, name: str, value: Union[int, float, torch.Tensor]) -> None:
        """Count (device values only where every rank's gradient was finite)."""
        self.stats.add(name, value, self.dev.ok)

    def unpeeled(self, cnt: Union[int, torch.Tensor], usize: Union[int, torch.Tensor],
                 what: str) -> None:
        """Entries peeling left: counted; on the CPU also logged (CUDA: stats() warns)."""
        self.add("unpeeled", cnt)
        if not isinstance(cnt, torch.Tensor) and cnt:
            self.warn_unpeeled(cnt, int(usize), what)


def sparsify_all(call: Call, inp: torch.Tensor, s: int, k: int, with_bitmap: bool = True,
                 per_shard: Optional[Callable[..., None]] = None,
                 order: Optional[Sequence[int]] = None,
                 value_dtype: Optional[torch.dtype] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of every shard with error feedback: (idx, val, bitmaps) of shape (N, ...).

    ``per_shard(r, idx, val, bm)`` runs right after shard r is selected, so its
    exchange starts before shard r+1 is (shards are independent: disjoint
    residual slices; the order only decides which exchange starts first).
    ``value_dtype`` overrides the config's for the kept values.
    """
    n, dev = call.world, inp.device
    idx = torch.empty(n, k, dtype=torch.int32, device=dev)
    val = torch.empty(n, k, dtype=value_dtype or call.cfg.value_dtype, device=dev)
    bm = torch.empty(n if with_bitmap else 1, _tagc.bitmap_bytes(s), dtype=torch.uint8,
                     device=dev)
    kw = dict(call.dev.kw)
    # on CUDA the threshold goes to a device scalar (no host sync)
    tau = torch.empty(n, dtype=torch.float32, device=dev) if call.dev.cuda else None
    for r in (range(n) if order is None else order):
        if tau is not None:
            kw["out"] = tau[r:r + 1]
        _tagc.sparsify(idx[r], val[r], bm[r if with_bitmap else 0], call.res(r, s),
                       inp[r * s:(r + 1) * s], k, **kw)
        if per_shard is not None:
            per_shard(r, idx, val, bm)
    return idx, val, bm


def dense(call: Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
    """No compression: each shard to its owner by one all-to-all (the honest
    gloo baseline: gloo's reduce-scatter is an all-reduce underneath)."""
    send = inp.view(call.world, -1)
    recv = torch.empty_like(send)
    call.comm.all_to_all(recv, send)
    torch.sum(recv.float(), dim=0, out=acc)


class PairsWire(NamedTuple):
    """One rank's message of k kept pairs of a shard in a pairs mode (``sparse``,
    ``auto``); every field follows from (mode, S, k, dtypes), the same on every rank.

    Attributes:
        value_dtype: the kept values' dtype.
        nbytes: the message size.
        pack: ``pack(buf, idx, val)`` writes the message.
        unpack: ``unpack(acc, buf)`` adds a received message.
        coding: ``auto``'s coding (``tagc_coding`` name); None for ``sparse``.
    """

    value_dtype: torch.dtype
    nbytes: int
    pack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    unpack: Callable[[torch.Tensor, torch.Tensor], None]
    coding: Optional[str]


def auto_value_dtype(cfg: TAGCConfig, grad_dtype: torch.dtype) -> torch.dtype:
    """The kept values' dtype in ``auto`` mode: ``value_dtype``, or the gradient's
    own dtype when that is narrower (bf16 gradients with fp32 values), so that
    the dense coding never sends more than the plain reduce-scatter would; the
    rounding goes to the residual like any value rounding."""
    return grad_dtype if grad_dtype.itemsize < cfg.value_dtype.itemsize else cfg.value_dtype


def pairs_wire(cfg: TAGCConfig, s: int, k: int, grad_dtype: torch.dtype,
               kw: Dict[str, int], exact_values: bool = False) -> PairsWire:
    """The message of k pairs of a shard of s: ``sparse``'s int32 offsets + values,
    or ``auto``'s coding of fewest bytes for (S, k, value dtype) (Elias-Fano
    positions, a bitmap, or dense values), which every rank derives from sizes
    alone: no extra exchange.

    Args:
        cfg: the config (``mode`` sparse or auto; any mode with ``exact_values``).
        s: shard length.
        k: pairs per message.
        grad_dtype: the gradient's dtype.
        kw: the ``_tagc`` call keywords (the CUDA stream).
        exact_values: ``auto``'s coding with fp32 values whatever the mode (the
            lossless to-everyone phase of :func:`spread_union`).
    Returns:
        the wire format.
    """
    if exact_values:
        c = _tagc.pairs_cheapest(s, k, torch.float32)
        return PairsWire(torch.float32, _tagc.pairs_bytes(s, k, torch.float32, c),
                         lambda b, i, v: _tagc.pairs_pack(b, i, v, s, c, **kw),
                         lambda a, b: _tagc.pairs_unpack_add(a, b, k, torch.float32, c, **kw),
                         c)
    if cfg.mode == "sparse":
        vd = cfg.value_dtype
        return PairsWire(vd, _tagc.sparse_bytes(k, vd),
                         lambda b, i, v: _tagc.sparse_pack(b, i, v, **kw),
                         lambda a, b: _tagc.sparse_unpack(a, b, k, vd, **kw), None)
    vd = auto_value_dtype(cfg, grad_dtype)
    c = _tagc.pairs_cheapest(s, k, vd)
    return PairsWire(vd, _tagc.pairs_bytes(s, k, vd, c),
                     lambda b, i, v: _tagc.pairs_pack(b, i, v, s, c, **kw),
                     lambda a, b: _tagc.pairs_unpack_add(a, b, k, vd, c, **kw), c)


def pairs(call: Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
    """``sparse`` and ``auto``: each rank's k kept pairs of shard r to its owner r,
    one message of a size every rank knows (:func:`pairs_wire`), so the receives
    are posted first and shard r leaves while shard r+1 is selected; the owner
    adds the N messages in rank order (so ``auto`` sums exactly what ``sparse``
    sums, bit for bit)."""
    n, s, rank = call.world, acc.numel(), call.rank
    k = call.k(s)
    wire = pairs_wire(call.cfg, s, k, inp.dtype, call.dev.kw)
    buf = torch.empty(n, wire.nbytes, dtype=torch.uint8, device=inp.device)
    recv = torch.empty_like(buf)
    works = call.comm.post_recvs(recv)

    def send(r: int, idx: torch.Tensor, val: torch.Tensor, bm: torch.Tensor) -> None:
        wire.pack(buf[r], idx[r], val[r])
        if r != rank:
            call.comm.post_send(works, buf, recv, r)

    sparsify_all(call, inp, s, k, with_bitmap=False, per_shard=send, order=call.comm.ring(),
                 value_dtype=wire.value_dtype)
    call.comm.wait(works)
    acc.zero_()
    for r in range(n):  # rank order: the same sum on every run and in every mode
        wire.unpack(acc, buf[r] if r == rank else recv[r])
    call.add("shard_slots", s)
    if wire.coding is not None:
        call.add("coded_" + wire.coding, n)


def quant(call: Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
    """Every other owner's shard on ``quant_format`` codes with error feedback;
    the own shard is added exact (it never leaves the rank)."""
    n, s, rank, kw = call.world, acc.numel(), call.rank, call.dev.kw
    fmt, block = call.cfg.quant_format, call.cfg.quant_block
    nb = codec.quant_bytes(s, fmt, block)
    buf = call.dev.empty("quant_send", (n, nb), torch.uint8, inp.device)
    recv = call.dev.empty("quant_recv", (n, nb), torch.uint8, inp.device)
    works = call.comm.post_recvs(recv)
    for r in call.comm.ring()[:-1]:
        codec.quant_encode(buf[r], call.res(r, s), inp[r * s:(r + 1) * s], fmt, block, **kw)
        call.comm.post_send(works, buf, recv, r)
    call.comm.wait(works)
    acc.zero_()
    for r in range(n):  # rank order: the same sum on every run
        if r != rank:
            codec.quant_decode_add(acc, recv[r], fmt, block, **kw)
            continue
        acc.add_(inp[r * s:(r + 1) * s])
        if call.cfg.ef21:
            # The own shard is "sent" uncompressed: it contributes v = g - h
            # in full and leaves nothing behind (so h becomes g).
            own = call.res(r, s)
            acc.add_(own)
            own.copy_(call.dev.keep(torch.zeros_like(own), own))
    call.add("union_size", s)
    call.add("shard_slots", s)


def exact(call: Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
    """Bitmap all-to-all (a true OR at the owner), a sketch sized from the union
    bound, and (CPU) a recovery exchange for what peeling leaves: lossless."""
    n, s, kw = call.world, acc.numel(), call.dev.kw
    k = call.k(s)
    idx, val, bm = sparsify_all(call, inp, s, k)
    recv_bm = torch.empty_like(bm)
    work = call.comm.all_to_all(recv_bm, bm, async_op=True)
    # While the bitmaps travel, encode every shard's sketch.
    m = math.ceil(call.cfg.sketch_factor * min(s, n * k))
    t = max(1, math.ceil(m / 3))
    seed = call.seed()
    sk = torch.empty(n, _tagc.sketch_buckets(t), dtype=call.cfg.value_dtype, device=inp.device)
    for r in range(n):
        _tagc.sketch_encode(sk[r], idx[r], val[r], s, t, seed, **kw)
    recv_sk = torch.empty_like(sk)
    work_sk = call.comm.all_to_all(recv_sk, sk, async_op=True)
    work.wait()
    union = torch.empty(bm.shape[1], dtype=torch.uint8, device=inp.device)
    _tagc.bitmap_or(union, recv_bm.view(-1), n, **kw)
    usize = call.dev.count(_tagc.popcount, union, s)
    work_sk.wait()
    total = recv_sk.float().sum(dim=0) if n > 1 else recv_sk[0].float()
    call.add("union_size", usize)
    call.add("shard_slots", s)
    if call.dev.cuda:
        # No recovery exchange on CUDA: its sizes depend on the unpeeled
        # counts, which only the host could turn into splits.  Entries
        # peeling leaves (rare at sketch_factor >= 1.23) get the median
        # estimate of their buckets and are counted in `unpeeled`
        # (`recovered` stays 0): CUDA exact mode is lossless only when
        # `unpeeled` is 0.
        cnt_dev = call.dev.count(_tagc.peel_decode, acc, total, union, s, t, seed,
                                 estimate=True, out_kw="count_out")
        call.add("unpeeled", cnt_dev)
        return
    unpeeled = torch.empty(max(usize, 1), dtype=torch.int32, device=inp.device)
    cnt = call.dev.count(_tagc.peel_decode, acc, total, union, s, t, seed, unpeeled=unpeeled,
                         estimate=False, out_kw="count_out")
    _recover(call, idx, val, k, unpeeled[:cnt], usize, acc)


def _recover(call: Call, idx: torch.Tensor, val: torch.Tensor, k: int, mine: torch.Tensor,
             usize: int, acc: torch.Tensor) -> None:
    """exact mode's second exchange: every owner names the positions peeling
    left, every rank answers with its kept value there; the owner sums."""
    n, rank, dev = call.world, call.rank, acc.device
    cnt = mine.numel()
    # Agree on who needs recovery (an N-element all-reduce of counts).
    counts = torch.zeros(n, dtype=torch.int64, device=dev)
    counts[rank] = cnt
    call.comm.all_reduce(counts, control=True)
    c = [int(x) for x in counts.tolist()]
    if sum(c) == 0:
        return
    call.add("recovered", cnt)
    call.unpeeled(cnt, usize, "recovered by a second exchange")
    # Owner names its unpeeled positions to every rank ...
    send_pos = mine.repeat(n) if cnt else torch.empty(0, dtype=torch.int32, device=dev)
    recv_pos = torch.empty(sum(c), dtype=torch.int32, device=dev)
    call.comm.all_to_all(recv_pos, send_pos, in_splits=[cnt] * n, out_splits=c)
    # ... each rank answers with its kept value there (0 if not kept) ...
    answers = torch.zeros(sum(c), dtype=call.cfg.value_dtype, device=dev)
    off = 0
    for r in range(n):
        if c[r]:
            pos = recv_pos[off:off + c[r]].long()
            kept = idx[r].long()
            j = torch.searchsorted(kept, pos).clamp_(max=k - 1)
            hit = kept[j] == pos
            answers[off:off + c[r]] = torch.where(hit, val[r][j], torch.zeros_like(val[r][j]))
        off += c[r]
    got = torch.empty(n * cnt, dtype=call.cfg.value_dtype, device=dev)
    call.comm.all_to_all(got, answers, in_splits=c, out_splits=[cnt] * n)
    # ... and the owner sums the answers: exact values, nothing lost.
    if cnt:
        acc[mine.long()] = got.view(n, cnt).float().sum(dim=0)


def paper(call: Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
    """The paper's Algorithm 1: index all-reduce SUM on ``index_bits`` lanes
    (carries and all), a fixed ``S/ratio`` sketch reduced to each owner."""
    n, s, rank, kw = call.world, acc.numel(), call.rank, call.dev.kw
    k = call.k(s)
    bits = call.cfg.index_bits
    lanes = torch.empty(n, _tagc.lanes_bytes(s, bits), dtype=torch.uint8, device=inp.device)
    t = max(1, math.ceil(math.ceil(s / call.cfg.ratio) / 3))
    seed = call.seed()
    sk = torch.empty(n, _tagc.sketch_buckets(t), dtype=call.cfg.value_dtype, device=inp.device)
    works: List[Any] = []

    def exchange(r: int, idx: torch.Tensor, val: torch.Tensor, bm: torch.Tensor) -> None:
        # Algorithm 1 per shard: SUM all-reduce of the lanes (carries included;
        # elementwise, so per-shard calls equal one call over the unit), then
        # the fixed-size sketch reduced to the owner.  Both run while shard
        # r+1 is selected and encoded.
        _tagc.lanes_pack(lanes[r], bm[r], s, bits, **kw)
        works.append(call.comm.all_reduce(lanes[r], async_op=True))
        _tagc.sketch_encode(sk[r], idx[r], val[r], s, t, seed, **kw)
        works.append(call.comm.reduce(sk[r], r, async_op=True))

    idx, val, bm = sparsify_all(call, inp, s, k, per_shard=exchange)
    call.comm.wait(works)
    union = torch.empty(bm.shape[1], dtype=torch.uint8, device=inp.device)
    _tagc.lanes_unpack(union, lanes[rank], s, bits, **kw)
    usize = call.dev.count(_tagc.popcount, union, s)
    cnt = call.dev.count(_tagc.peel_decode, acc, sk[rank], union, s, t, seed, estimate=True,
                         out_kw="count_out")
    call.add("union_size", usize)
    call.add("shard_slots", s)
    call.unpeeled(cnt, usize, "paper mode estimates them")
    # Collision loss: every rank sees all reduced lanes, so each counts its own
    # kept entries that the carries erased from the union (the paper's loss).
    ub = torch.empty_like(bm)
    for r in range(n):
        _tagc.lanes_unpack(ub[r], lanes[r], s, bits, **kw)
    pos = idx.long()
    bit = (ub.gather(1, pos >> 3).long() >> (pos & 7)) & 1
    lost = bit == 0
    if call.dev.cuda:  # boolean indexing would sync; where() keeps it on the device
        call.add("collision_dropped", lost.sum())
        call.add("collision_dropped_l1", gate(val.float().abs(), lost).sum())
        return
    call.add("collision_dropped", int(lost.sum()))
    call.add("collision_dropped_l1", float(val.float().abs()[lost].sum()))


# --------------------------------------------------------------------------------------
# The to-everyone phase: every rank's message to every rank (one all-gather), decoded
# alike on every rank, so every rank ends with the same values.  ``spread(call, x, out,
# place)``: ``x`` is this rank's vector; with ``place`` rank j's decoded message goes
# to row j of ``out`` (R, len(x)) (the second phase of a compressed all-reduce: x is
# the sum this rank owns), else every message is added to ``out`` in rank order (the
# all-gather form: x is this rank's own contribution).  Every spread but dense's adds
# into ``out``, which arrives zeroed (two-phase EF21 on the CPU: holding the owners'
# estimates, which the decoded changes update in place; tagc/hsdp.py).  The
# feedback state is ``call.residual`` (x's length, None: none): whatever the code
# leaves of x + residual is kept for the next call.

def _rows(out: torch.Tensor, place: bool, world: int) -> List[torch.Tensor]:
    return [out[j] for j in range(world)] if place else [out] * world


def spread_dense(call: Call, x: torch.Tensor, out: torch.Tensor, place: bool) -> None:
    """No compression: an all-gather of the owners' sums, or (all-gather form) one
    SUM all-reduce in the gradient's dtype, bit for bit what native HSDP does."""
    if place:
        call.comm.all_gather(out, x.float())
        return
    g = x.clone()
    call.comm.all_reduce(g)
    out.copy_(g)


def spread_quant(call: Call, x: torch.Tensor, out: torch.Tensor, place: bool) -> None:
    """x + residual on ``quant_format`` codes (an owner's sum: ``cfg.out_format()``),
    every rank's codes to every rank; the sender decodes its own message too (every
    rank must hold the same values)."""
    fmt = call.cfg.out_format() if place else call.cfg.quant_format
    block, kw = call.cfg.quant_block, call.dev.kw
    nb = codec.quant_bytes(x.numel(), fmt, block)
    mine = call.dev.empty("spread_mine", (nb,), torch.uint8, x.device)
    codec.quant_encode(mine, call.residual, x, fmt, block, **kw)
    every = call.dev.empty("spread_every", (call.world, nb), torch.uint8, x.device)
    call.comm.all_gather(every, mine)
    for j, row in enumerate(_rows(out, place, call.world)):  # rank order: one sum
        codec.quant_decode_add(row, every[j], fmt, block, **kw)
    if not place:
        call.add("union_size", x.numel())
        call.add("shard_slots", x.numel())


def _spread_pairs(call: Call, x: torch.Tensor, out: torch.Tensor, place: bool, k: int,
                  wire: PairsWire, residual: Optional[torch.Tensor]) -> None:
    """The top-k of x + residual as one pairs message per rank, to every rank."""
    kw = dict(call.dev.kw)
    idx = torch.empty(k, dtype=torch.int32, device=x.device)
    val = torch.empty(k, dtype=wire.value_dtype, device=x.device)
    bm = torch.empty(_tagc.bitmap_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    if call.dev.cuda:  # the threshold to a device scalar: no host sync
        kw["out"] = torch.empty(1, dtype=torch.float32, device=x.device)
    _tagc.sparsify(idx, val, bm, residual, x, k, **kw)
    mine = torch.empty(wire.nbytes, dtype=torch.uint8, device=x.device)
    wire.pack(mine, idx, val)
    every = torch.empty(call.world, wire.nbytes, dtype=torch.uint8, device=x.device)
    call.comm.all_gather(every, mine)
    for j, row in enumerate(_rows(out, place, call.world)):
        wire.unpack(row, every[j])
    if not place:
        call.add("shard_slots", x.numel())
    if wire.coding is not None:
        call.add("coded_" + wire.coding, call.world)


def spread_pairs(call: Call, x: torch.Tensor, out: torch.Tensor, place: bool) -> None:
    """``sparse`` and ``auto``: k of x + residual (an owner re-selects k of its sum;
    what it drops stays in its residual), in the mode's pairs message."""
    k = call.k(x.numel())
    wire = pairs_wire(call.cfg, x.numel(), k, x.dtype, call.dev.kw)
    _spread_pairs(call, x, out, place, k, wire, call.residual)


def spread_union(call: Call, x: torch.Tensor, out: torch.Tensor, place: bool) -> None:
    """``exact`` and ``paper``, owners' sums only (``place``): a sum of N ranks' k
    kept entries has at most N*k non-zeros, so the top min(S, N*k) of it, fp32
    values in ``auto``'s cheapest coding, is the sum itself: lossless, no state."""
    if not place:
        raise NotImplementedError(f"mode {call.cfg.mode!r} has no all-gather form (its "
                                  "union needs the to-the-owner phase)")
    k = min(x.numel(), call.world * call.k(x.numel()))
    wire = pairs_wire(call.cfg, x.numel(), k, x.dtype, call.dev.kw, exact_values=True)
    _spread_pairs(call, x.float(), out, place, k, wire, None)


SPREADS: Dict[str, Callable[[Call, torch.Tensor, torch.Tensor, bool], None]] = {
    "dense": spread_dense, "quant": spread_quant, "sparse": spread_pairs,
    "auto": spread_pairs, "exact": spread_union, "paper": spread_union}


TRANSPORTS: Dict[str, Callable[[Call, torch.Tensor, torch.Tensor], None]] = {
    "dense": dense, "sparse": pairs, "auto": pairs, "quant": quant, "exact": exact,
    "paper": paper}
