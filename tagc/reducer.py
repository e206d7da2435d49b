"""The object FSDP holds for one unit: :class:`UnitReducer`.

It owns everything one unit needs across steps (identity, process group, step counter,
feedback state, counters) and does one reduction per call (:meth:`UnitReducer.reduce`):
checks, the warm-up's plain steps, the ranks' agreement on non-finite gradients, the
transport of ``TRANSPORTS[mode]``, EF21's estimate, and the division FSDP's default
path would have done.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import codec, memory, transports
from .bypass import Bypass
from .comm import Comm
from .config import TAGCConfig
from .device import CodecStreams, Exec, nonfinite, nonfinite_vote, poison_nonfinite
from .selection import UnitSpec
from .stats import UnitStats

logger = logging.getLogger("tagc_hook")

# what _tagc.quant_unit_encode's kernel counts on CUDA, in its order
UNIT_COUNTS = ("compressed_calls", "nonfinite_fallbacks", "residual_resets", "union_size",
               "shard_slots")


def send_owed(dev: Exec, g: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What a plain send of ``g`` carries when a residual is owed: ``g + residual`` in
    ``g``'s dtype; the residual keeps only that rounding, so nothing owed is lost.

    Args:
        dev: the call's device side (a poisoned CUDA call leaves the residual as it was).
        g: the gradient (or sum) to send.
        residual: the feedback owed on it (updated in place).
    Returns:
        the tensor to send.
    """
    v = g.float() + residual.float()
    send = v.to(g.dtype)
    residual.copy_(dev.keep((v - send.float()).to(residual.dtype), residual))
    return send


class UnitReducer:
    """One FSDP unit's reduce-scatter, compressed or plain.

    Args:
        cfg: the config (the same on every rank).
        spec: the unit (:class:`~tagc.selection.UnitSpec`: name, index, sizes,
            selection, device); its fields are this object's attributes too.
        group: the process group of the reduce-scatter.
        rank, world: this rank and the group size.
        pre, post: the default path's pre/post divide factors.
        streams: the codec streams shared by the model's reducers (CUDA).
    """

    # what a checkpoint's layout record calls this reducer's buffers (tagc/positions.py)
    FORM = "fsdp"
    # whether eligible calls take the unit path (:meth:`_unit_eligible`); False: always
    # the general one (the tests compare the two)
    UNIT_PATH = True

    def __init__(self, cfg: TAGCConfig, spec: UnitSpec, group: Any, rank: int, world: int,
                 pre: float, post: float, streams: CodecStreams) -> None:
        self.cfg, self.spec = cfg, spec
        # the spec's fields, read on every call: plain attributes (the spec is frozen)
        self.name, self.index, self.device = spec.name, spec.index, spec.device
        self.numel, self.flat_numel = spec.numel, spec.flat_numel
        self.selected_numel, self.compressed = spec.selected_numel, spec.compressed
        self.group, self.rank, self.world = group, rank, world
        self.pre, self.post, self.streams = pre, post, streams
        self.step = 0
        # where each element of the flat buffer belongs (tagc/positions.py), set by
        # the FSDP glue; checkpoints store it so that another shape can map them
        self.layout: Optional[Dict[str, Any]] = None
        self.residual: Optional[torch.Tensor] = None
        # EF21 only: the owner's running sum of every rank's estimate of this
        # rank's shard (fp32, one shard long).
        self.estimate: Optional[torch.Tensor] = None
        self.stats = UnitStats()
        self.warned_unpeeled = False
        # the feedback guard's threshold (0: off) and the last pooled statistic it saw
        self.guard_ratio = cfg.guard_threshold(spec.device) if self.keeps_feedback else 0.0
        self.last_guard_stat: Optional[float] = None
        # this call's EF21 damping factor (ef21_damping; set by the vote, None: none)
        self.damp: Any = None
        # the path the last call took: "plain", "compress" or "settle" (the
        # plain sum with the feedback state settled); HSDP's second phase follows it
        self.last_path = "plain"
        # the timing-based choice of path (cfg.bypass_every; compressed units only)
        self.bypass: Optional[Bypass] = \
            Bypass(cfg.bypass_every) if cfg.bypass_every and spec.compressed else None
        # whether this call takes the unit path (set per call by _reduce)
        self.unit_call = False

    # ----------------------------------------------------------------- feedback state
    @property
    def row_group(self) -> Any:
        """The group whose ranks hold one checkpoint row each (this unit's group)."""
        return self.group

    @property
    def keeps_feedback(self) -> bool:
        """Whether this unit keeps error-feedback state (checkpoints hold exactly these)."""
        return self.compressed and self.cfg.feeds_back

    def feedback_buffers(self) -> List[Tuple[str, int, torch.dtype]]:
        """(attribute, length, dtype) of each feedback state as kept between calls
        (:func:`tagc.memory.unit_buffers`): the residual (its codes with
        ``residual_code``), and with ``ef21`` the owner's estimate of its shard."""
        if not self.keeps_feedback:
            return []
        return memory.unit_buffers(self.cfg, self.flat_numel, self.estimate_numel)

    def outer_buffers(self) -> List[Tuple[str, int, torch.dtype]]:
        """(attribute, length, dtype) of local steps' outer state (tagc/local.py):
        none outside custom HSDP's local steps."""
        return []

    def state_buffers(self) -> List[Tuple[str, int, torch.dtype]]:
        """Every persistent buffer a checkpoint holds: :meth:`feedback_buffers`, then
        :meth:`outer_buffers`."""
        return self.feedback_buffers() + self.outer_buffers()

    def coded_residuals(self) -> Dict[str, int]:
        """The residuals kept as codes (``residual_code``): attribute -> entries of
        its fp32 working copy."""
        if not self.keeps_feedback or self.cfg.residual_code == "none":
            return {}
        return {"residual": self.flat_numel}

    def _open_codes(self, dev: Exec) -> Dict[str, Optional[torch.Tensor]]:
        """Decode every coded residual into its fp32 working copy, which the call
        uses in its place (the attribute holds it until :meth:`_close_codes`).

        Returns:
            the codes as held before the call, by attribute.
        """
        held: Dict[str, Optional[torch.Tensor]] = {}
        fmt, block = self.cfg.residual_code, self.cfg.quant_block
        for name, length in self.coded_residuals().items():
            codes = held[name] = getattr(self, name)
            if codes is not None:
                work = dev.empty(f"{name}_work", (length,), torch.float32, codes.device)
                work.zero_()
                codec._tagc.quant_decode_add(work, codes, fmt, block, **dev.kw)
                setattr(self, name, work)
        return held

    def _close_codes(self, dev: Exec, held: Dict[str, Optional[torch.Tensor]],
                     changed: bool) -> None:
        """Code every working copy back (round to nearest: what that drops is not
        fed back), or, when the call left the state alone (``changed`` False: a
        plain call, an exception), put the old codes back untouched, so a state
        is never rounded twice for nothing.  On CUDA a poisoned call keeps the
        old codes."""
        fmt, block = self.cfg.residual_code, self.cfg.quant_block
        for name, codes in held.items():
            work = getattr(self, name)
            if work is None or work is codes or not changed:
                setattr(self, name, codes)
                continue
            if codes is None:
                codes = torch.zeros(memory.coded_bytes(work.numel(), fmt, block),
                                    dtype=torch.uint8, device=work.device)
            new = codes if dev.ok is None else torch.empty_like(codes)
            codec._tagc.quant_encode(new, None, work, fmt, block, **dev.kw)
            if new is not codes:
                codes.copy_(dev.keep(new, codes))
            setattr(self, name, codes)

    def _guard_residuals(self, dev: Exec) -> bool:
        """Reset every residual that is not finite, before the call uses it.

        A residual is this rank's own unsent error: a NaN or Inf there (a corrupted
        checkpoint, an overflow in a lower-precision residual, codes whose scale went
        bad) would be added to every later gradient of the unit and never leave.
        Dropping it loses only what it owed.  Under EF21 the residual is the rank's
        estimate of its own gradient, which the owner's estimate must keep adding up:
        there EF21's guard (``guard_ratio``, on by default with it) settles every
        rank together instead.

        Args:
            dev: the call's device side.
        Returns:
            whether a residual was reset (CPU; on CUDA the reset and its count stay on
            the device, no host sync, and False is returned).
        """
        reset = False
        if self.cfg.ef21:
            return reset
        for name in ("residual", "residual_out"):
            r = getattr(self, name, None)
            if r is None or not r.is_floating_point():
                continue
            bad = ~torch.isfinite(r).all()
            if dev.cuda:
                r.masked_fill_(bad, 0)
                self.stats.add("residual_resets", bad)
                continue
            if bad:
                r.zero_()
                self.stats.add("residual_resets", 1)
                logger.warning("TAGC: unit %r: %s not finite, reset to zero (what it owed "
                               "is dropped)", self.name, name)
                reset = True
        return reset

    def scale_feedback(self, factor: float) -> None:
        """Multiply every feedback state by ``factor`` (``TAGCState.scale_residuals``);
        the coded residuals are decoded, scaled and coded again, all of them in one
        open/close (opening decodes every coded residual)."""
        names = [n for n, _, _ in self.feedback_buffers() if getattr(self, n) is not None]
        if not names:
            return
        dev = Exec(getattr(self, names[0]))
        held = self._open_codes(dev)
        for name in names:
            getattr(self, name).mul_(factor)
        self._close_codes(dev, held, True)

    @property
    def estimate_numel(self) -> int:
        """EF21's estimate: the sum this rank receives (its shard of the unit)."""
        return self.flat_numel // self.world

    # ----------------------------------------------------------------- one reduction
    def reduce(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = what the default reduce-scatter of ``inp`` would produce.

        Called by FSDP2 on its reduce-scatter stream and by FSDP1 on its
        post-backward stream (R below).  On CUDA the work runs on the codec
        stream S of the device and the host only enqueues::

          R  (FSDP reduce-scatter): copy-in(g) ─ev0┐                                      ┌wait(S)─ FSDP post-reduce
          S  (TAGC codec):              wait(ev0) ─ encode shards ─ lanes/sketch ─┐ ... bitmap_or/popcount/peel/decode(out) ─┘
          NCCL (ProcessGroupNCCL):                             after S ─ a2a/isend ─ ... ─ work.wait() on S
          AG (FSDP all-gather prefetch of the next unit): runs concurrently with all of the above
          Host: only enqueues; no synchronize / .item()

        ``R.wait_stream(S)`` happens before returning because FSDP records its
        reduce-scatter event on R right after the comm returns.  ``inp`` and
        ``out`` belong to FSDP's streams, so they are ``record_stream``-ed on
        S; everything else (feedback state, buffers, device counters) is
        allocated while S is current.  Data-dependent decisions never reach
        the host on CUDA: see :func:`~tagc.device.poison_nonfinite` and the
        exact transport (no recovery exchange on CUDA).

        Args:
            inp: the unit's flat gradient, N shards of ``out.numel()``.
            out: this rank's shard of the reduced gradient (written).
        """
        if not inp.is_cuda:
            self._reduce(inp, out)
            return
        with self.streams.around(inp, out):
            self._reduce(inp, out)

    def _reduce(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        inp = self._check(inp, out)
        dev = Exec(inp, self.streams.scratch)  # the CPU/CUDA decision of this call
        comm = Comm(self.group, self.rank, self.world, self.stats, dev)
        self.stats.add("calls", 1)
        self.stats.add("default_wire_bytes", self.default_wire_bytes(inp))
        self.last_path = "plain"
        step = self.step
        # the unit path decodes, guards and re-codes the residual inside its one call
        self.unit_call = self._unit_eligible(dev, inp, out)
        held = {} if self.unit_call else self._open_codes(dev)
        reset = False if self.unit_call else self._guard_residuals(dev)
        done = False
        try:
            self._route(comm, dev, inp, out)
            self.after(comm, dev, out, step)
            done = True
        finally:
            self._close_codes(dev, held, done and (self.last_path != "plain" or reset))

    def after(self, comm: Comm, dev: Exec, out: torch.Tensor, step: int) -> None:
        """What follows the to-the-owner phase once its path is known
        (:attr:`last_path`): nothing here; HSDP's two-phase all-reduce sends the
        owners' sums to everyone (tagc/hsdp.py).

        Args:
            comm: the call's collectives.
            dev: the call's device side.
            out: this rank's reduced shard.
            step: the call's step (``self.step`` before the call).
        """

    def _route(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        """The call's path: plain, warm-up, the vote's decision, the bypass."""
        if out.numel() == 0:
            return
        if not self.compressed:
            self._plain(comm, inp, out)
            return
        if self.cfg.theta_at(self.step) is None:
            # Warm-up's dense steps: self.step is the same on every rank, so all
            # take this path together.  Non-finite values need no agreement
            # here: the plain path passes them on and no feedback state exists yet.
            self.stats.add("dense_step_calls", 1)
            self._plain(comm, inp, out)
            self.step += 1
            return
        if self.cfg.compresses:
            codec.require_codec()
        decision = self._agree(comm, inp)
        if decision == "plain":
            self._plain(comm, inp, out)
            return
        if self.keeps_feedback and self.residual is None:
            self.residual = self._zero_codes(inp.device) if self.unit_call else \
                torch.zeros(self.flat_numel, dtype=self.cfg.residual_dtype, device=inp.device)
        if decision == "reset":
            # Outside the bypass's bookkeeping: a reset is neither path's timing, and
            # every rank skips that bookkeeping alike (the decision is the ranks' sum).
            self.stats.add("guard_resets", 1)
            self._settle(comm, dev, inp, out)
        elif self.bypass is None:
            self._compressed(comm, dev, inp, out)
        else:
            path = self.bypass.next_path()
            with self.bypass.timed(path, dev.cuda):
                if path == "plain":
                    self._bypassed(comm, dev, inp, out)
                else:
                    self._compressed(comm, dev, inp, out)
            self.bypass.finish(comm, inp.device)
        self.step += 1

    def default_wire_bytes(self, inp: torch.Tensor) -> float:
        """What FSDP's default reduction of ``inp`` puts on an ideal network (a
        reduce-scatter: (N-1)/N of it)."""
        return (self.world - 1) / self.world * inp.numel() * inp.element_size()

    def transport(self, call: transports.Call, inp: torch.Tensor, acc: torch.Tensor) -> None:
        """The compressed exchange: the mode's to-the-owner transport."""
        transports.TRANSPORTS[self.cfg.mode](call, inp, acc)

    def plain_sum(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor) -> None:
        """The uncompressed sum of ``inp`` over the group into ``out`` (N > 1): the
        SUM reduce-scatter."""
        comm.reduce_scatter(out, inp)

    def _compressed(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        self.last_path = "compress"
        if self.unit_call:
            self._unit_quant(comm, dev, inp, out)
            return
        self._apply_damping()
        f = self.cfg.residual_factor
        if f != 1.0 and self.residual is not None and not self.cfg.ef21:
            # partial feedback: the optimizer's error per call is f e - e' (e - e' with
            # the whole residual, -e' without), the rounding bias left (1 - f) of it
            self.residual.mul_(f)
        acc = dev.empty("acc", (out.numel(),), torch.float32, out.device)
        call = transports.Call(self.cfg, self.index, self.step,
                               self.residual if self.cfg.compresses else None,
                               comm, dev, self.stats, self._warn_unpeeled)
        self.transport(call, inp, acc)
        if self.cfg.ef21 and self.cfg.compresses:
            self._ef21_update(dev, inp, acc)
        divisor = self.pre * self.post
        if divisor != 1:
            acc.div_(divisor)
        out.copy_(acc)

    def _unit_eligible(self, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether this call's compressed exchange takes the unit path
        (:meth:`_unit_quant`): the quant transport with a coded residual and
        nothing around it that needs the residual decoded (EF21, damping, the
        guard, the bypass, another reducer's transport).  On the CPU with three
        ranks or more the general path stays: it encodes shard r + 1 while
        shard r travels (``Comm.stepped``).

        Args:
            dev: the call's device side.
            inp, out: the call's tensors (``inp`` flat and contiguous).
        Returns:
            the decision, the same on every rank (it reads only the config, the
            sizes and the device kind, which the ranks share).
        """
        cfg = self.cfg
        if not (self.UNIT_PATH and self.keeps_feedback and cfg.mode == "quant"
                and cfg.residual_code != "none" and not cfg.ef21 and not cfg.ef21_damping
                and not self.guard_ratio and self.bypass is None
                and codec.block_records(cfg.quant_format)
                and type(self).transport is UnitReducer.transport
                and type(self).after is UnitReducer.after
                and self.world > 1 and (dev.cuda or self.world == 2)):
            return False
        s = out.numel()
        return (s > 0 and s % cfg.quant_block == 0 and inp.numel() == self.world * s
                and out.is_contiguous() and out.dtype in (torch.float32, torch.bfloat16)
                and inp.dtype in (torch.float32, torch.bfloat16)
                and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr())

    def _zero_codes(self, device: torch.device) -> torch.Tensor:
        """The residual of the first compressed call as codes: zeros, coded."""
        fmt, block = self.cfg.residual_code, self.cfg.quant_block
        codes = torch.empty(memory.coded_bytes(self.flat_numel, fmt, block), dtype=torch.uint8,
                            device=device)
        kw = {"stream": torch.cuda.current_stream(device).cuda_stream} if codes.is_cuda else {}
        codec._tagc.quant_encode(codes, None, torch.zeros(self.flat_numel, device=device),
                                 fmt, block, **kw)
        return codes

    def _unit_quant(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        """The quant transport with the residual kept as codes, one extension call per
        side: ``_tagc.quant_unit_encode`` decodes the residual (reset when it is not
        finite), scales it by ``residual_factor``, writes every other owner's message
        and codes the residual back; ``_tagc.quant_unit_decode`` sums the own shard and
        the received messages in rank order and divides.  The same bytes and values as
        :meth:`_open_codes`, :meth:`_guard_residuals`, the ``quant`` transport, the
        division and :meth:`_close_codes` one after another (tests/test_unit_path.py),
        without the unit-sized fp32 working copy.  On CUDA the ranks' summed vote
        (``dev.vote``, not 0 when a rank's gradient is not finite) makes the encoder send
        NaN and keep the residual, as poisoning the shards does on the general path; the
        encode kernel adds the call's counters (:data:`UNIT_COUNTS`) where it was not.
        """
        cfg, n, s, rank = self.cfg, self.world, out.numel(), self.rank
        fmt, rfmt, block = cfg.quant_format, cfg.residual_code, cfg.quant_block
        nb = codec.quant_bytes(s, fmt, block)
        buf = dev.empty("quant_send", (n, nb), torch.uint8, inp.device)
        recv = dev.empty("quant_recv", (n, nb), torch.uint8, inp.device)
        works = comm.post_recvs(recv)
        if dev.cuda:
            counts = self.stats.vector(UNIT_COUNTS, inp.device)
            codec._tagc.quant_unit_encode(
                buf, self.residual, inp, n, rank, fmt, rfmt, block, cfg.residual_factor,
                counts=counts, vote=dev.vote,
                flags=self.streams.flags(inp.device), **dev.kw)
        else:
            if codec._tagc.quant_unit_encode(buf, self.residual, inp, n, rank, fmt, rfmt, block,
                                             cfg.residual_factor):
                self.stats.add("residual_resets", 1)
                logger.warning("TAGC: unit %r: residual not finite, reset to zero (what it "
                               "owed is dropped)", self.name)
            self.stats.add("union_size", s)
            self.stats.add("shard_slots", s)
        for r in comm.ring()[:-1]:
            comm.post_send(works, buf, recv, r)
        comm.wait(works)
        codec._tagc.quant_unit_decode(out, recv, inp[rank * s:(rank + 1) * s], n, rank, fmt,
                                      block, self.pre * self.post, **dev.kw)

    def _bypassed(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        """The plain reduce-scatter in place of compression (tagc/bypass.py)."""
        self.stats.add("bypassed_calls", 1)
        self._settle(comm, dev, inp, out)

    def _settle(self, comm: Comm, dev: Exec, inp: torch.Tensor, out: torch.Tensor) -> None:
        """The plain reduce-scatter with the feedback state settled, so that nothing
        owed is lost (a bypassed call, a guard reset): the residual travels with the
        gradient; EF21's estimates become the exact sums and each rank's ``h`` its
        own gradient."""
        self.last_path = "settle"
        if not self.keeps_feedback:
            self._plain(comm, inp, out, counted=False)
            return
        if self.cfg.ef21:
            acc = inp.float() if self.world == 1 else \
                torch.empty(out.numel(), dtype=torch.float32, device=out.device)
            if self.world > 1:
                self.plain_sum(comm, acc, inp.float())
            if self.estimate is None:
                self.estimate = torch.zeros_like(acc)
            self.estimate.copy_(dev.keep(acc, self.estimate))
            self.residual.copy_(dev.keep(-inp.float(), self.residual))
            out.copy_(acc / (self.pre * self.post))
            return
        self._plain(comm, send_owed(dev, inp, self.residual), out, counted=False)

    def _check(self, inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Refuse what cannot be reduced; the flat contiguous input."""
        if not inp.is_floating_point() or not out.is_floating_point():
            raise TypeError(f"TAGC: unit {self.name!r} has a non-floating gradient "
                            f"({inp.dtype}); only floating gradients can be reduced")
        if inp.numel() != self.shards_in(inp) * out.numel():
            raise RuntimeError(f"TAGC: unit {self.name!r}: input of {inp.numel()} elements "
                               f"does not split into {self.shards_in(inp)} shards of "
                               f"{out.numel()}")
        if self.compressed and out.numel() and inp.numel() != self.flat_numel:
            # The feedback state is indexed by position in this buffer; a buffer
            # of another length (FSDP2 leaves out parameters without a gradient)
            # would mix up parameters.  Sizes agree across ranks, so every rank
            # raises here, none waits in a collective.
            raise RuntimeError(f"TAGC: unit {self.name!r}: reduce-scatter input has "
                               f"{inp.numel()} elements, expected {self.flat_numel} (every "
                               "parameter of a compressed unit that requires grad at "
                               "register() must get a gradient each step; FSDP2: "
                               "set_reduce_scatter_unused_params(True) sends zeros for "
                               "unused ones)")
        inp = inp.reshape(-1)
        return inp if inp.is_contiguous() else inp.contiguous()

    def _agree(self, comm: Comm, inp: torch.Tensor) -> str:
        """The path of this call, the same on every rank: ``"compress"``, ``"plain"``
        (a rank's gradient is not finite) or ``"reset"`` (the feedback guard).

        Without the guard and EF21's damping this is :meth:`_agree_finite`'s
        4-byte vote.  With either, the vote widens to four float64 sums in the
        same single all-reduce: the non-finite flag and :meth:`_feedback_terms`
        (``||g||^2``, ``<g, h>``, ``||h||^2``), from which every rank derives
        the same guard ratio and the same damping factor :attr:`damp`.  On
        CUDA (damping only: register refuses the guard there) the sums stay
        on the device (:meth:`_agree_device`).

        Args:
            comm: the call's collectives (the vote counts as control bytes).
            inp: the unit's flat gradient.
        Returns:
            the path; also sets :attr:`last_guard_stat` (the pooled ratio) when
            the guard is on and every gradient is finite, and :attr:`damp`.
        """
        self.damp = None
        if not (self.guard_ratio or self.cfg.ef21_damping):
            return "compress" if self._agree_finite(comm, inp) else "plain"
        if comm.dev.cuda:
            return self._agree_device(comm, inp)
        vec = torch.zeros(4, dtype=torch.float64, device=inp.device)
        if not bool(nonfinite(inp)):
            vec[1:] = self._feedback_terms(inp)
        else:
            vec[0] = 1.0
        comm.all_reduce(vec, control=True)
        flag, gg, gh, hh = vec.tolist()
        if flag != 0:
            self.stats.add("nonfinite_fallbacks", 1)
            return "plain"
        self.stats.add("compressed_calls", 1)
        if self.cfg.ef21_damping:
            lam = gh / hh if hh > 0 else 1.0
            # NaN (a corrupted state) or a negative correlation: clip; the guard
            # (if on) resets a NaN state below
            self.damp = min(max(lam, 0.0), 1.0) if math.isfinite(lam) else 1.0
        if not self.guard_ratio:
            return "compress"
        # EF21: ||g - h||^2 from the three sums; residual feedback: what it owes
        num = gg - 2.0 * gh + hh if self.cfg.ef21 else hh
        self.last_guard_stat = num / gg if gg > 0 else (0.0 if num == 0 else float("inf"))
        # "not <=": a NaN sum fires too
        return "compress" if num <= self.guard_ratio * gg else "reset"

    def _agree_device(self, comm: Comm, inp: torch.Tensor) -> str:
        """:meth:`_agree` on CUDA with damping: the same four sums, all-reduced on
        the device; the flag gates the call as in :meth:`_agree_finite` and the
        damping factor stays a device scalar (1 on a poisoned call, so the
        state is left as it was)."""
        bad_here = nonfinite(inp)
        terms = self._feedback_terms(inp)
        vec = torch.cat([bad_here.to(torch.float64).reshape(1), terms])
        comm.all_reduce(vec, control=True)
        bad = vec[0] > 0
        self.stats.add("nonfinite_fallbacks", bad)
        comm.dev.ok = ~bad
        self.stats.add("compressed_calls", comm.dev.ok)
        if self.cfg.compresses:
            poison_nonfinite(inp.view(self.shards_in(inp), -1), bad)
        gh, hh = vec[2], vec[3]
        lam = torch.where(hh > 0, gh / hh, torch.ones_like(hh)).clamp(0.0, 1.0)
        self.damp = torch.where(comm.dev.ok & torch.isfinite(lam), lam, torch.ones_like(lam))
        return "compress"

    def _feedback_terms(self, inp: torch.Tensor) -> torch.Tensor:
        """This rank's share of the vote's sums over the whole unit: ``(||g||^2,
        <g, h>, ||h||^2)`` in float64, with ``h`` the feedback state before the
        call (EF21: the rank's estimate of its gradient, stored as ``-h`` in
        the residual; residual feedback: what it owes).  Before the first
        compressed call no state exists: ``h = 0``.  The dot products run in
        fp32 (the residual's dtype, one pass each) and are summed in float64.

        Args:
            inp: the unit's flat gradient.
        Returns:
            a float64 tensor of 3 on ``inp``'s device.
        """
        g = inp.float()
        out = torch.zeros(3, dtype=torch.float64, device=inp.device)
        out[0] = torch.dot(g, g)
        if self.residual is not None:
            r = self.residual.float()
            out[1] = -torch.dot(g, r)
            out[2] = torch.dot(r, r)
        return out

    def _apply_damping(self) -> None:
        """EF21's damped step (``ef21_damping``): ``h <- lam h`` on this rank and the
        owner's estimate (the sum of every rank's ``h``) ``<- lam est``, before the
        transport codes ``g - lam h``.  Nothing to scale before the first call."""
        if self.damp is None or self.residual is None:
            return
        self.residual.mul_(self.damp)
        if self.estimate is not None:
            self.estimate.mul_(self.damp)

    def _agree_finite(self, comm: Comm, inp: torch.Tensor) -> bool:
        """Whether to compress: the ranks agree (one 4-byte all-reduce) before any
        feedback state is touched.  False: a rank's gradient is not finite and
        every rank takes the plain path (CPU).  On CUDA the flag stays on the
        device: a non-finite call still compresses, with every shard poisoned
        so that no state changes and the NaN reaches every owner's output
        (dense sums values, so NaN/Inf reach the owners without poisoning);
        it counts in ``nonfinite_fallbacks`` only and advances ``step``
        (identically on every rank, so the seeds still agree)."""
        dev = comm.dev
        if dev.cuda:
            vote = nonfinite_vote(inp)
            comm.all_reduce(vote, control=True)
            if self.unit_call:  # its kernel reads the vote, poisons and counts
                dev.vote = vote
                return True
            dev.ok = vote == 0
            bad = ~dev.ok
            self.stats.add("nonfinite_fallbacks", bad)
            self.stats.add("compressed_calls", dev.ok)
            if self.cfg.compresses:
                poison_nonfinite(inp.view(self.shards_in(inp), -1), bad)
            return True
        flag = torch.zeros(1, dtype=torch.int32, device=inp.device)
        if bool(nonfinite(inp)):
            flag.fill_(1)
        comm.all_reduce(flag, control=True)
        if int(flag.item()) != 0:
            self.stats.add("nonfinite_fallbacks", 1)
            return False
        self.stats.add("compressed_calls", 1)
        return True

    def shards_in(self, inp: torch.Tensor) -> int:
        """How many shards ``inp`` holds (one per rank of the group: a reduce-scatter)."""
        return self.world

    def _plain(self, comm: Comm, inp: torch.Tensor, out: torch.Tensor,
               counted: bool = True) -> None:
        # Exactly the default path's arithmetic: pre-divide, SUM reduce-scatter,
        # post-divide (gloo's AVG has been unreliable, so SUM is used always).
        if counted:
            self.stats.add("plain_calls", 1)
        if self.pre != 1:
            inp = inp / self.pre
        if self.world == 1:
            out.copy_(inp)
        else:
            self.plain_sum(comm, out, inp)
        if self.post != 1:
            out.div_(self.post)

    def _ef21_update(self, dev: Exec, inp: torch.Tensor, acc: torch.Tensor) -> None:
        """EF21 after a transport: ``acc`` holds what every rank sent for this
        rank's shard, the residual ``v - sent`` with ``v = g - h``.

        ``h' = h + sent = g - (v - sent)``, stored negated: residual -= g.
        The owner's estimate takes what arrived and becomes the output.  On
        CUDA both updates are gated by the call's "all finite" flag (a
        poisoned call leaves both states as they were and passes the NaN on).
        """
        if self.estimate is None:
            self.estimate = torch.zeros(acc.numel(), dtype=torch.float32, device=acc.device)
        if dev.ok is None:
            self.residual.sub_(inp)
            self.estimate.add_(acc)
            acc.copy_(self.estimate)
            return
        self.residual.sub_(torch.where(dev.ok, inp, torch.zeros_like(inp)))
        new = self.estimate + acc
        self.estimate.copy_(dev.keep(new, self.estimate))
        acc.copy_(dev.keep(new, acc))

    def _warn_unpeeled(self, cnt: int, usize: int, what: str) -> None:
        if not self.warned_unpeeled:
            self.warned_unpeeled = True
            logger.warning("TAGC unit %r: %d of %d union entries left unpeeled at step %d; "
                           "%s (logged once per unit)", self.name, cnt, usize, self.step, what)

    # ----------------------------------------------------------------- stats
    def stats_dict(self) -> Dict[str, Any]:
        """This unit's identity and counters (see ``TAGCState.stats``)."""
        d: Dict[str, Any] = {"index": self.index, "numel": self.numel,
                             "selected_numel": self.selected_numel,
                             "compressed": self.compressed, "step": self.step}
        d.update(self.stats.as_dict())
        if self.stats.device.get("unpeeled") is not None and d["unpeeled"] \
                and not self.warned_unpeeled:
            self.warned_unpeeled = True
            logger.warning("TAGC unit %r: %d union entries left unpeeled so far on CUDA; "
                           "they got the median estimate (logged once per unit)",
                           self.name, d["unpeeled"])
        return d
