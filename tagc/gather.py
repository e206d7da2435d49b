"""Quantized parameter all-gathers on FSDP2 (``TAGCConfig.gather``).

FSDP2 gathers each unit's parameters before its forward and again before its
backward (``FSDPParamGroup.unshard``), one flat buffer per unit:
``input_tensor = output_tensor.narrow(0, rank * n, n)`` holds this rank's shard,
i.e. each parameter's dim-0 shard padded to ``ceil(rows / N)`` rows, in group order
(``_fsdp_collectives.foreach_all_gather``).  ``FSDPModule.set_custom_all_gather``
lets a comm object fill ``output_tensor``; :class:`GatherComm` is that object.

Protocol of one call (every rank runs the same steps on the same bytes):

1. encode this rank's shard: per parameter (a *segment*, so no block mixes two
   parameters' ranges), blocks of ``gather_block`` values, a fp32 scale
   ``max|w| / qmax`` and round-to-nearest codes (``_tagc.wq_encode``).  The same
   masters give the same bytes, so the forward gather and the backward re-gather
   hand FSDP the same weights.  A block holding NaN/Inf gets a sentinel scale
   instead of codes.  ``fp4``: E2M1 codes and a power-of-two scale byte per block
   (``_tagc.fp4_encode``, each segment on its own, optionally rotated by the unit's
   seeded block Hadamard transform); a NaN/Inf anywhere in the shard makes every
   scale byte of the message E8M0's NaN;
2. one all-gather of the N messages (they have the same size on every rank: the
   segment lengths are the padded shard lengths, equal on every rank);
3. every rank decodes every message into its slice of the output, its own shard
   last (so a refused message never leaves the own slice half-written, and the
   exact fallback below still reads the true shard; fp4 messages are checked for NaN
   scales before any is decoded).  If any message holds the
   sentinel, every rank sees it in the same bytes, so all of them fall back to the
   exact all-gather of the unit for this call, with no extra agreement round.

``gather_delta`` (int8/int4, SDP4Bit's weight differences): every rank keeps ``ref``,
the unit's gathered weights as it reconstructed them, the same on every rank.  The
owner codes ``shard - ref[own]`` instead of the shard and flags, in one byte after the
codes, whether its shard differs from the one it coded last; each rank adds the decoded
change of every flagged message to its ``ref`` (in the gather dtype, so the owner's
mirror and every receiver round alike) and hands FSDP ``ref``.  The loop is closed: what
one call's codes round away is part of the next call's change, so the weights trail
the masters by a fraction of one step's update, not by a fraction of the weights.  An
unflagged message leaves ``ref`` as it is, so the backward re-gather of a step hands
FSDP the forward's weights bit for bit.  The unit's first call, and the first after
:meth:`GatherComm.reset` (a TAGC state load), gather exactly and start ``ref`` there; a
NaN/Inf fallback restarts it from that exact gather too.  Each side is one codec call
(``wq_delta_encode``: compare, code and remember the shard; ``wq_delta_decode``: add the
change and write FSDP's slice); on CUDA the kernels write and read the flag on the
device (no host synchronisation).  On the CPU a call inside a backward (FSDP's
re-gather of what the forward gathered: the masters have not moved since, on every
rank) first all-gathers the flag bytes alone; when no rank's shard changed, every rank
hands FSDP ``ref`` and the messages are never sent (what decoding N unchanged messages
gives), so a step's re-gathers cost N - 1 bytes per rank instead of a message each.
Any changed shard sends every message, as in the forward.  Every rank takes the same
branch: the calls are the same on every rank, and so are the flags they all read.

What is never quantized: a call over another group than the unit's shard group
(``reshard_after_forward=int`` re-gathers the post-forward shards over the smaller
group: those shards are slices of an already dequantized output, so the exact
gather keeps the backward weights equal to the forward ones), all-gather dtypes
other than fp32/bf16 (FSDP uses uint8 when a unit's dtypes differ), units with a
non-floating parameter, and every call inside :meth:`GatherSwitch.exact_gathers`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm, fsdp2
from .codec import _tagc
from .config import TAGCConfig
from .device import Exec
from .overlap import JobWork, Overlap, in_backward
from .stats import UnitStats

logger = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AGBase
except ImportError:  # pragma: no cover - older torch without custom comms
    _AGBase = object  # type: ignore[assignment,misc]

_QUANTIZABLE = (torch.float32, torch.bfloat16)


def message_bytes(segments: Sequence[int], fmt: str, block: int, delta: bool = False) -> int:
    """Bytes of one rank's shard on the gather codes: blocks never cross a segment.

    Args:
        segments: the shard's segment lengths (one per parameter).
        fmt: a gather format other than ``none``.
        block: values per scale.
        delta: ``gather_delta``'s message (``wq_delta_bytes``: the codes and a flag byte).
    Returns:
        the message size, the same on every rank.
    """
    if fmt == "fp4":
        return sum(int(_tagc.fp4_bytes(int(n), block)) for n in segments)
    size = _tagc.wq_delta_bytes if delta else _tagc.wq_bytes
    return int(size(torch.tensor([int(n) for n in segments], dtype=torch.int64), fmt, block))


# E8M0's NaN: a scale byte every fp4 decoder turns into NaN values
_FP4_NAN_SCALE = 0xFF


class GatherSwitch:
    """The model-wide "gather exactly" switch shared by every unit's comm."""

    def __init__(self) -> None:
        self.exact_depth = 0

    @property
    def exact(self) -> bool:
        """Whether gathers are exact now."""
        return self.exact_depth > 0

    @contextlib.contextmanager
    def exact_gathers(self, modules: Sequence[nn.Module]) -> Iterator[None]:
        """Gather exactly inside the block.

        FSDP keeps some units unsharded between calls (the root after forward,
        ``reshard_after_forward=False``), holding weights gathered under the other
        setting; every module is resharded on entry and on exit so each side
        gathers afresh under its own setting.

        Args:
            modules: the model's FSDP2 modules.
        """
        _reshard(modules)
        self.exact_depth += 1
        try:
            yield
        finally:
            self.exact_depth -= 1
            _reshard(modules)


def _reshard(modules: Sequence[nn.Module]) -> None:
    for m in modules:
        m.reshard()


class _OrderedGather(_AGBase):  # type: ignore[misc,valid-type]
    """An FSDP2 all-gather comm whose exchange runs on the model's worker thread when
    there is one (``fsdp_overlap``, CPU tensors: tagc/overlap.py), FSDP waiting on
    the returned work before it reads the output; else on the calling thread.

    Args:
        overlap: the worker, or None.
        order: the forward order a call outside a backward records, or None.
        index: the unit's index in ``order``.
    """

    def __init__(self, overlap: Optional[Overlap], order: Optional[fsdp2.ForwardOrder],
                 index: int) -> None:
        self.overlap, self.order, self.index = overlap, order, index

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> Optional[JobWork]:
        """Fill ``output_tensor`` with every rank's shard.

        FSDP waits on a returned work object, or on nothing: the call returns None
        with the output written (CPU) or its writes queued on the current stream
        (CUDA, which FSDP's event after this call orders), or a :class:`JobWork`
        for the worker's job (``fsdp_overlap``).
        """
        exact = self._exact_now()  # now: the switch may flip before the job runs
        backward = in_backward()  # on this thread: the worker runs no backward
        ov = self.overlap
        if ov is None or output_tensor.is_cuda:
            self._gather(output_tensor, input_tensor, group, exact, backward)
            return None
        if self.order is not None and not backward:
            self.order.seen(self.index)
        return ov.run(
            lambda: self._gather(output_tensor, input_tensor, group, exact, backward),
            "parameter all-gather")

    def _exact_now(self) -> bool:
        """Whether this call gathers exactly (read when FSDP calls, not when it runs)."""
        return True

    def _gather(self, out: torch.Tensor, inp: torch.Tensor, group: Any, exact: bool,
                backward: bool) -> None:
        """The exchange itself (each subclass's own), on whichever thread runs it;
        ``backward``: FSDP called from inside a backward."""
        raise NotImplementedError


class OrderedGatherComm(_OrderedGather):
    """FSDP's own all-gather of a unit (``DefaultAllGather``'s call, the same bytes
    the same way), through the worker: with ``fsdp_overlap`` and no ``gather``, so
    the gathers keep their place in the worker's order beside the reduce-scatters
    (tagc/overlap.py); counts nothing."""

    def _gather(self, out: torch.Tensor, inp: torch.Tensor, group: Any, exact: bool,
                backward: bool) -> None:
        comm.flat_all_gather()[1](out, inp, group=group)


class GatherComm(_OrderedGather):
    """FSDP2 custom all-gather of one unit's parameters, block-quantized.

    Args:
        name: the unit's name (logs).
        cfg: the config (``gather``, ``gather_block``).
        segments: padded shard length of each parameter of the unit, in FSDP's
            group order: the segments of one rank's flat shard.
        group: the unit's shard process group (calls over another group are exact).
        quantize: False for units that are always gathered exactly (a parameter
            that is not floating).
        stats: the unit's counters (``gather_*``).
        switch: the model's exact-gather switch.
        overlap, order, index: as :class:`_OrderedGather`.
    """

    def __init__(self, name: str, cfg: TAGCConfig, segments: List[int], group: Any,
                 quantize: bool, stats: UnitStats, switch: GatherSwitch,
                 overlap: Optional[Overlap] = None,
                 order: Optional[fsdp2.ForwardOrder] = None, index: int = 0) -> None:
        super().__init__(overlap, order, index)
        self.name, self.cfg, self.group = name, cfg, group
        self.segments = torch.tensor(segments, dtype=torch.int64)
        self.shard_numel = sum(segments)
        self.quantize, self.stats, self.switch = quantize, stats, switch
        # one rank's message: its size depends on the segments alone, the same everywhere
        self.message_bytes = message_bytes(segments, cfg.gather, cfg.gather_block,
                                           cfg.gather_delta)
        # gather_delta: the unit's weights as every rank reconstructed them, and this
        # rank's shard as it last coded it; None until the first (exact) call
        self.delta = cfg.gather_delta
        self._ref: Optional[torch.Tensor] = None
        self._sent: Optional[torch.Tensor] = None
        # fp4: each segment coded on its own, (values, bytes) spans of the shard and
        # message; one rotation seed per unit, from (config seed, unit): the forward
        # gather and the backward re-gather code the same masters to the same bytes
        self._spans: List[Tuple[int, int, int, int]] = []
        scales = []  # where the messages hold scale bytes (after each segment's codes)
        v = b = 0
        for n in segments if cfg.gather == "fp4" else ():
            nb = int(_tagc.fp4_bytes(int(n), cfg.gather_block))
            self._spans.append((v, v + int(n), b, b + nb))
            scales.append(torch.arange(b + (int(n) + 1) // 2, b + nb))
            v, b = v + int(n), b + nb
        self._scale_at = torch.cat(scales) if scales else torch.zeros(0, dtype=torch.int64)
        self._fp4_kw = {"seed": _tagc.seed_derive(cfg.seed, index, 0),
                        "rotate": cfg.gather_rotate}
        self._seg_dev: Optional[torch.Tensor] = None
        self._warned = False

    def _exact_now(self) -> bool:
        return self.switch.exact

    def reset(self) -> None:
        """Forget ``gather_delta``'s reconstruction: the next call gathers exactly.
        Call it on every rank alike (the ranks must agree on which calls are exact),
        with no gather of the unit in flight."""
        self._ref = self._sent = None

    def held_bytes(self) -> int:
        """Bytes ``gather_delta`` keeps between calls (0 before the first call)."""
        return sum(t.numel() * t.element_size() for t in (self._ref, self._sent)
                   if t is not None)

    def _gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                group: Any, exact: bool, backward: bool) -> None:
        world = dist.get_world_size(group)
        nb = input_tensor.numel() * input_tensor.element_size()
        if exact:
            # validation under exact_gathers(): the user's evaluation, not training
            # traffic, so not counted (the counters describe the training's gathers)
            _all_gather(output_tensor, input_tensor, group, world)
            return
        self.stats.add("gather_calls", 1)
        self.stats.add("gather_default_wire_bytes", (world - 1) * nb)
        why = self._exact_reason(input_tensor, group)
        if why is None:
            if self.delta and not self._holds(output_tensor, input_tensor):
                # the reconstruction starts from the true weights, on every rank alike
                self._exact(output_tensor, input_tensor, group, world, nb)
                self._keep(output_tensor, input_tensor)
                return
            try:
                self._quantized(output_tensor, input_tensor, group, world, backward)
                return
            except _tagc.NonFiniteError:
                # every rank decoded the same bytes and is here too
                self.stats.add("gather_nonfinite", 1)
                logger.warning("TAGC unit %r: a parameter block holds NaN/Inf; this "
                               "gather is exact on every rank", self.name)
            self._exact(output_tensor, input_tensor, group, world, nb)
            if self.delta:
                self._keep(output_tensor, input_tensor)
            return
        self._exact(output_tensor, input_tensor, group, world, nb)

    def _holds(self, out: torch.Tensor, inp: torch.Tensor) -> bool:
        """Whether ``gather_delta``'s reconstruction fits this call."""
        ref, sent = self._ref, self._sent
        return ref is not None and sent is not None and ref.shape == out.shape and \
            ref.dtype == out.dtype and ref.device == out.device and sent.dtype == inp.dtype

    def _keep(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Start the reconstruction from an exact gather's output."""
        self._ref = out.detach().clone()
        self._sent = inp.detach().clone()

    def _exact_reason(self, inp: torch.Tensor, group: Any) -> Optional[str]:
        """Why this call is gathered exactly, or None when it is quantized."""
        if not self.quantize:
            return "a non-floating parameter"
        if group is not self.group:
            return "post-forward group (reshard_after_forward=int)"
        if inp.dtype not in _QUANTIZABLE:
            why = f"all-gather dtype {inp.dtype}"
        elif inp.numel() != self.shard_numel:
            why = (f"shard of {inp.numel()} elements, the unit's parameters add up to "
                   f"{self.shard_numel}")
        else:
            return None
        if not self._warned:
            self._warned = True
            logger.warning("TAGC unit %r: parameters gathered exactly (%s)", self.name, why)
        return why

    def _segs(self, device: torch.device) -> Any:
        """The segment lengths where the codec wants them (a device copy on CUDA)."""
        if device.type != "cuda":
            return self.segments
        if self._seg_dev is None or self._seg_dev.device != device:
            self._seg_dev = self.segments.to(device)
        return self._seg_dev

    def _quantized(self, out: torch.Tensor, inp: torch.Tensor, group: Any,
                   world: int, backward: bool) -> None:
        fmt, block = self.cfg.gather, self.cfg.gather_block
        segs = self._segs(inp.device)
        kw = Exec(inp).kw  # the codec on the current stream (CUDA), as every transport
        mb = self.message_bytes
        recv = torch.empty(world, mb, dtype=torch.uint8, device=inp.device)
        rank = dist.get_rank(group)
        if self.delta:
            self._delta_encode(recv[rank], inp, rank, segs, kw)
            if backward and not inp.is_cuda and self._unchanged(recv[rank], rank, group, world):
                out.copy_(self._ref)
                return
        elif fmt == "fp4":
            self._fp4_encode(recv[rank], inp, kw)
        else:
            _tagc.wq_encode(recv[rank], inp, segs, fmt, block, **kw)
        # ring all-gather: this rank's message travels to the N-1 others
        self.stats.add("gather_wire_bytes", (world - 1) * mb)
        self.stats.add("gather_quantized_calls", 1)
        # in place, as FSDP's own gather: the input is the output's own row (gloo
        # wants the output flat, world * numel, not stacked)
        _all_gather(recv, recv[rank], group, world)
        n = inp.numel()
        if fmt == "fp4" and not recv.is_cuda and \
                bool((recv[:, self._scale_at] == _FP4_NAN_SCALE).any()):
            # a NaN scale in some rank's message, before anything is decoded (the own
            # slice of the output is the input the exact fallback reads): every rank
            # sees the same bytes.  CUDA: no host sync; NaN weights, as an exact gather
            # of NaN masters gives too
            raise _tagc.NonFiniteError("a parameter block holds NaN/Inf")
        if self.delta:
            self._delta_decode(out, recv, rank, segs, kw)
            return
        for r in [r for r in range(world) if r != rank] + [rank]:  # own shard last
            if fmt == "fp4":
                self._fp4_decode(out[r * n:(r + 1) * n], recv[r], kw)
            else:
                _tagc.wq_decode(out[r * n:(r + 1) * n], recv[r], segs, fmt, block, **kw)

    def _delta_encode(self, msg: torch.Tensor, inp: torch.Tensor, rank: int, segs: Any,
                      kw: Any) -> None:
        """``gather_delta``: the codes of ``shard - ref[own]`` and the changed flag, in
        one codec pass (all zeros when the shard is bit for bit the one last sent)."""
        n = inp.numel()
        _tagc.wq_delta_encode(msg, inp, self._sent, self._ref[rank * n:(rank + 1) * n], segs,
                              self.cfg.gather, self.cfg.gather_block, **kw)

    def _unchanged(self, msg: torch.Tensor, rank: int, group: Any, world: int) -> bool:
        """``gather_delta`` in a backward: all-gather every rank's flag byte (the
        message's last); True when no rank's shard changed since it last coded it."""
        flags = torch.empty(world, dtype=torch.uint8)
        flags[rank] = msg[-1]
        self.stats.add("gather_wire_bytes", world - 1)
        _all_gather(flags, flags[rank:rank + 1], group, world)
        if bool(flags.any()):
            return False
        self.stats.add("gather_quantized_calls", 1)
        self.stats.add("gather_unchanged_calls", 1)
        return True

    def _delta_decode(self, out: torch.Tensor, recv: torch.Tensor, rank: int, segs: Any,
                      kw: Any) -> None:
        """``gather_delta``: every flagged message's change into ``ref`` and each slice
        of ``ref`` into ``out``, one codec pass per message.  The change is added in fp32
        and rounded to the gather dtype, the same on the owner and every receiver.  A
        sentinel block raises NonFiniteError (CPU) with ``ref`` partly updated: the
        caller's exact fallback restarts it."""
        n = out.numel() // recv.shape[0]
        for r in range(recv.shape[0]):
            _tagc.wq_delta_decode(out[r * n:(r + 1) * n], self._ref[r * n:(r + 1) * n],
                                  recv[r], segs, self.cfg.gather, self.cfg.gather_block, **kw)

    def _fp4_encode(self, msg: torch.Tensor, inp: torch.Tensor, kw: Any) -> None:
        """This rank's message, segment by segment; NaN scales throughout if a block
        holds NaN/Inf (the peers must see it in the bytes, not in an exception here)."""
        block = self.cfg.gather_block
        try:
            for v0, v1, b0, b1 in self._spans:
                _tagc.fp4_encode(msg[b0:b1], None, inp[v0:v1], block, **self._fp4_kw, **kw)
        except _tagc.NonFiniteError:
            msg.fill_(_FP4_NAN_SCALE)

    def _fp4_decode(self, out: torch.Tensor, msg: torch.Tensor, kw: Any) -> None:
        """One rank's message into its slice of the output (fp32: the codec adds)."""
        block = self.cfg.gather_block
        dst = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
        dst.zero_()
        for v0, v1, b0, b1 in self._spans:
            _tagc.fp4_decode_add(dst[v0:v1], msg[b0:b1], block, **self._fp4_kw, **kw)
        if dst is not out:
            out.copy_(dst)

    def _exact(self, out: torch.Tensor, inp: torch.Tensor, group: Any, world: int,
               nb: int) -> None:
        self.stats.add("gather_wire_bytes", (world - 1) * nb)
        self.stats.add("gather_exact_calls", 1)
        _all_gather(out, inp, group, world)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, world: int) -> None:
    """Every rank's ``inp`` into its row of ``out``: one exchange between two gloo
    ranks (``tagc.comm.exchanges_pairwise``), else the backend's all-gather (gloo wants
    the output flat, world * numel, not stacked)."""
    if comm.exchanges_pairwise(group, world, inp):
        comm.pair_all_gather(out, inp, dist.get_rank(group), group)
    else:
        comm.flat_all_gather()[1](out.view(-1), inp, group=group)


def install(cfg: TAGCConfig, mods: List[nn.Module], stats: List[UnitStats],
            names: List[str], switch: GatherSwitch, overlap: Optional[Overlap] = None,
            order: Optional[fsdp2.ForwardOrder] = None) -> List[GatherComm]:
    """Give each FSDP2 module its all-gather comm: a :class:`GatherComm` with
    ``cfg.gather``, else (with ``overlap``) an :class:`OrderedGatherComm`; nothing
    without either.

    Args:
        cfg: the config.
        mods: the FSDP2 modules with parameters, one per unit.
        stats: each unit's counters (the gather counters go beside its reduction's).
        names: each unit's name.
        switch: the exact-gather switch.
        overlap: the worker that runs the gathers (``fsdp_overlap``), or None.
        order: the forward order the gathers record (with ``overlap``).
    Returns:
        the quantizing comms, one per module (none without ``cfg.gather``).
    """
    comms = []
    for i, (m, st, name) in enumerate(zip(mods, stats, names)):
        if cfg.gather == "none":
            if overlap is not None:
                m.set_custom_all_gather(OrderedGatherComm(overlap, order, i))
            continue
        pg = fsdp2.param_groups(m)[0]
        segs = [int(fp.padded_sharded_param_size.numel()) for fp in pg.fsdp_params]
        floating = all(fp.sharded_param.is_floating_point() for fp in pg.fsdp_params)
        gc = GatherComm(name, cfg, segs, pg.mesh_info.shard_process_group, floating, st,
                        switch, overlap, order, i)
        m.set_custom_all_gather(gc)
        comms.append(gc)
    return comms
