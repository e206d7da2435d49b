"""Compressed pipeline-stage boundaries on stock ``torch.distributed.pipelining``.

A pipeline sends, per microbatch, the last activation of a stage forward and its
gradient backward.  Here both travel as codes: the stage's module is wrapped so that
its output is a *message* (:class:`BoundarySend`) and the next stage's module starts
by decoding it (:class:`BoundaryRecv`).  The message is a 1-D float32 tensor whose
bytes are the codes (``uint8`` viewed as ``float32``): the pipeline's P2P sends and
receives it like any activation, as ``4 * len`` bytes, and autograd carries the
gradient leg the same way: :class:`BoundaryRecv`'s backward encodes the gradient of
the decoded activation into a message of the same length, which the pipeline sends
back as "the gradient of the message", and :class:`BoundarySend`'s backward decodes
it.  Nothing in ``torch.distributed.pipelining`` is patched or subclassed; the one
thing it must not do is arithmetic on a message, and it does none (it receives into
buffers, sends, and hands the tensors to autograd).  The message's bits may spell
NaN as a float: they are never read as numbers.

What crosses a boundary (:class:`BoundaryLayout`): ``rows`` vectors of ``width``
values (rows = microbatch x sequence), coded by :class:`PipelineConfig`'s ``format``
forward and ``grad_format`` backward:

* ``fp32``/``bf16``: the values themselves (bf16 rounds to nearest even);
* ``int8``/``int4``: the C codec's block records (``_tagc.wq_*``, the quantized
  parameter gather's format; CUDA twin in ``cuda/``): per row, blocks of ``block``
  consecutive values along the hidden dimension, each an fp32 scale
  ``max|v| / qmax`` and round-to-nearest codes.  No feedback and no randomness: the
  same activations always give the same bytes.

With ``subspace_k`` (Protocol Models, arXiv 2506.01260) the model itself keeps the
residual stream as ``x0(tokens) + U c`` (:class:`Subspace`, and the GPT-2 of
:mod:`tagc.train.model`), so a boundary sends the ``k`` coefficients ``c`` and the
token ids (uint16 when the vocabulary allows, else int32) from which the next stage
rebuilds ``x0`` exactly; the gradient leg is ``dL/dc``, ``k`` values.  Either code
applies to ``c``.

Both directions carry a message of the same length (the gradient of a tensor has its
shape): the longer of the two legs, so a finer gradient code than the forward one
costs its bytes both ways.  Non-finite values are refused on the rank that would send
them (``FloatingPointError``), before anything is sent; under torchrun the other
ranks are then stopped by the launcher.

Memory: per microbatch in flight, one message on each side (``message_bytes``), and
the receiver's decoded activation, which the stage holds for its backward anyway.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .codec import _tagc, require_codec
from .config import _check_int, _from_mapping
from .device import Exec

logger = logging.getLogger(__name__)

__all__ = ["PipelineConfig", "BoundaryLayout", "BoundarySend", "BoundaryRecv",
           "CompressedStage", "Subspace", "pipeline_stage"]

VALUE_FORMATS = ("fp32", "bf16", "int8", "int4")
SCHEDULES = ("gpipe", "1f1b")
_BYTES_PER_VALUE = {"fp32": 4, "bf16": 2}


@dataclass
class PipelineConfig:
    """How a pipeline's stage boundaries are coded (``configs/tagc-pp-*.yaml``).

    Attributes:
        format: the forward leg's code of the values crossing a boundary:
            ``fp32`` (as computed, the uncompressed baseline), ``bf16``, ``int8`` or
            ``int4`` (block records, one fp32 scale per ``block`` values of a row).
        grad_format: the backward leg's code (the gradient of those values); None:
            the same as ``format``.
        block: values per scale along the hidden dimension (int8/int4), 1..65536;
            a row's last block may be shorter.
        subspace_k: 0, or the dimension of Protocol Models' subspace: the model keeps
            its residual stream as ``x0(tokens) + U c`` and a boundary sends the ``k``
            coefficients and the token ids.  Needs a model built for it
            (``GPTConfig.subspace_k``); 0 < k.
        subspace_seed: seed of the basis ``U`` and of the frozen embeddings
            (:class:`Subspace`); the same on every stage, so nothing else is sent.
        subspace_std: standard deviation of the frozen token and position tables
            (the high-rank part of the stream), > 0.
        schedule: ``gpipe`` (all forwards, then all backwards) or ``1f1b``.
        microbatches: microbatches per step (the batch is split along dim 0).
    """

    format: str = "int8"
    grad_format: Optional[str] = None
    block: int = 64
    subspace_k: int = 0
    subspace_seed: int = 0
    subspace_std: float = 0.02
    schedule: str = "1f1b"
    microbatches: int = 4

    def __post_init__(self) -> None:
        if self.format not in VALUE_FORMATS:
            raise ValueError(f"format: one of {VALUE_FORMATS}, got {self.format!r}")
        if self.grad_format is None:
            self.grad_format = self.format
        if self.grad_format not in VALUE_FORMATS:
            raise ValueError(f"grad_format: one of {VALUE_FORMATS}, got {self.grad_format!r}")
        for name, lo, hi in (("block", 1, 1 << 16), ("subspace_k", 0, None),
                             ("subspace_seed", 0, 2 ** 63 - 1), ("microbatches", 1, None)):
            _check_int(name, getattr(self, name), lo, hi)
        if isinstance(self.subspace_std, bool) or not isinstance(self.subspace_std, (int, float)) \
                or not 0 < self.subspace_std < float("inf"):
            raise ValueError(f"subspace_std: must be a positive number, got {self.subspace_std!r}")
        self.subspace_std = float(self.subspace_std)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: one of {SCHEDULES}, got {self.schedule!r}")

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "PipelineConfig":
        """Build from a mapping; unknown keys raise ``ValueError``."""
        return _from_mapping(cls, data, "PipelineConfig")

    @classmethod
    def from_yaml(cls, path: Any, overrides: Optional[Dict[str, Any]] = None
                  ) -> "PipelineConfig":
        """Load a YAML preset (``configs/tagc-pp-int8.yaml``); unknown keys raise.

        Args:
            path: the YAML file (a mapping of field names to values).
            overrides: fields replacing the file's.
        Returns:
            the validated config.
        """
        from tagc.presets import load_mapping

        return cls.from_dict({**load_mapping(path), **(overrides or {})})


def value_bytes(rows: int, width: int, fmt: str, block: int) -> int:
    """Bytes of ``rows`` vectors of ``width`` values in code ``fmt``."""
    if fmt in _BYTES_PER_VALUE:
        return rows * width * _BYTES_PER_VALUE[fmt]
    require_codec()
    # one segment per row: a block never spans two tokens
    return int(_tagc.wq_bytes(torch.full((rows,), width, dtype=torch.int64), fmt, block))


@dataclass(frozen=True)
class BoundaryLayout:
    """One boundary's message: what it carries and its exact size.

    Attributes:
        shape: the shape of the values crossing (``(..., width)``; rows = the
            product of the leading dimensions).
        cfg: the codes.
        ids_shape: the shape of the token ids that travel forward with the values
            (subspace), or None.
        vocab_size: ids are uint16 when it is at most 65536, else int32.
    """

    shape: Tuple[int, ...]
    cfg: PipelineConfig
    ids_shape: Optional[Tuple[int, ...]] = None
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) < 1 or any(s < 1 for s in self.shape):
            raise ValueError(f"boundary shape must be non-empty and positive, got {self.shape}")
        if self.ids_shape is not None and self.vocab_size < 1:
            raise ValueError("token ids travel: give the vocabulary size")

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def id_bytes(self) -> int:
        """Bytes of one token id on the wire (0: no ids travel)."""
        if self.ids_shape is None:
            return 0
        return 2 if self.vocab_size <= 1 << 16 else 4

    @functools.cached_property
    def forward_bytes(self) -> int:
        """The forward leg's payload: the coded values, then the ids."""
        ids = 0 if self.ids_shape is None else math.prod(self.ids_shape) * self.id_bytes
        return self.forward_value_bytes + ids

    @functools.cached_property
    def backward_bytes(self) -> int:
        """The backward leg's payload: the coded gradient of the values."""
        return value_bytes(self.rows, self.width, self.cfg.grad_format, self.cfg.block)

    @functools.cached_property
    def message_numel(self) -> int:
        """float32 elements of the message (both legs: the longer payload)."""
        return -(-max(self.forward_bytes, self.backward_bytes) // 4)

    @property
    def message_bytes(self) -> int:
        """Bytes one message puts on the wire, each way (``4 * message_numel``)."""
        return 4 * self.message_numel

    def empty_message(self, device: Any = "cpu") -> torch.Tensor:
        """A zeroed message (static metadata for the pipeline stage)."""
        return torch.zeros(self.message_numel, dtype=torch.float32, device=device)

    # -- the codes -----------------------------------------------------------------

    @functools.cached_property
    def _cpu_segs(self) -> torch.Tensor:
        # one segment per row: a block never spans two tokens
        return torch.full((self.rows,), self.width, dtype=torch.int64)

    @functools.cached_property
    def _dev_segs(self) -> Dict[torch.device, torch.Tensor]:
        return {}

    def _segs(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._cpu_segs
        # one copy per device, read-only: no host-to-device copy per message
        if device not in self._dev_segs:
            self._dev_segs[device] = self._cpu_segs.to(device)
        return self._dev_segs[device]

    @functools.cached_property
    def forward_value_bytes(self) -> int:
        """The forward leg's coded values (before the ids)."""
        return value_bytes(self.rows, self.width, self.cfg.format, self.cfg.block)

    def encode_values(self, x: torch.Tensor, fmt: str, out: torch.Tensor) -> None:
        """Write ``x``'s code into ``out`` (uint8, exactly its size)."""
        if fmt == "fp32":
            out.copy_(x.detach().float().contiguous().view(-1).view(torch.uint8))
        elif fmt == "bf16":
            out.copy_(x.detach().to(torch.bfloat16).contiguous().view(-1).view(torch.uint8))
        else:
            v = x.detach()
            if v.dtype not in (torch.float32, torch.bfloat16):
                v = v.float()
            # CUDA: on the current stream, as every codec call (tagc.device.Exec)
            _tagc.wq_encode(out, v.contiguous().view(-1), self._segs(x.device), fmt,
                            self.cfg.block, **Exec(v).kw)

    def decode_values(self, buf: torch.Tensor, fmt: str) -> torch.Tensor:
        """The fp32 values of a code (``buf`` uint8, exactly its size)."""
        if fmt == "fp32":
            return buf.clone().view(torch.float32).view(self.shape)
        if fmt == "bf16":
            return buf.clone().view(torch.bfloat16).float().view(self.shape)
        out = torch.empty(self.rows * self.width, dtype=torch.float32, device=buf.device)
        try:
            _tagc.wq_decode(out, buf, self._segs(buf.device), fmt, self.cfg.block,
                            **Exec(buf).kw)
        except _tagc.NonFiniteError as exc:  # the sender refuses these: a corrupt message
            raise FloatingPointError(f"pipeline boundary: a received block is flagged "
                                     f"non-finite ({exc})") from None
        return out.view(self.shape)

    def _ids_dtype(self) -> torch.dtype:
        return torch.uint16 if self.id_bytes == 2 else torch.int32

    def pack_forward(self, x: torch.Tensor, ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The forward message of ``x`` (and ``ids``)."""
        msg = torch.zeros(self.message_numel, dtype=torch.float32, device=x.device)
        raw = msg.view(torch.uint8)
        nv = self.forward_value_bytes
        self.encode_values(x, self.cfg.format, raw[:nv])
        if self.ids_shape is not None:
            n = math.prod(self.ids_shape)
            raw[nv:nv + n * self.id_bytes].copy_(
                ids.detach().reshape(-1).to(self._ids_dtype()).view(torch.uint8))
        return msg

    def unpack_forward(self, msg: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(values, ids or None)`` of a forward message."""
        raw = msg.detach().contiguous().view(torch.uint8)
        nv = self.forward_value_bytes
        x = self.decode_values(raw[:nv], self.cfg.format)
        ids = None
        if self.ids_shape is not None:
            n = math.prod(self.ids_shape)
            ids = raw[nv:nv + n * self.id_bytes].clone().view(self._ids_dtype()) \
                .to(torch.int64).view(self.ids_shape)
            if self.vocab_size and bool((ids >= self.vocab_size).any()):
                raise ValueError(f"pipeline boundary: a received token id is >= the "
                                 f"vocabulary size {self.vocab_size} (a corrupt message)")
        return x, ids

    def pack_backward(self, g: torch.Tensor) -> torch.Tensor:
        """The backward message of the gradient ``g`` of the values."""
        msg = torch.zeros(self.message_numel, dtype=torch.float32, device=g.device)
        nb = self.backward_bytes
        self.encode_values(g, self.cfg.grad_format, msg.view(torch.uint8)[:nb])
        return msg

    def unpack_backward(self, msg: torch.Tensor) -> torch.Tensor:
        """The gradient of the values in a backward message."""
        raw = msg.detach().contiguous().view(torch.uint8)
        return self.decode_values(raw[:self.backward_bytes], self.cfg.grad_format)


def _check(t: torch.Tensor, shape: Tuple[int, ...], what: str) -> None:
    """A boundary tensor must be the layout's shape, floating and finite."""
    if tuple(t.shape) != shape:
        raise ValueError(f"pipeline boundary: {what} has shape {tuple(t.shape)}, the "
                         f"stages were built for {shape}")
    if not t.is_floating_point():
        raise TypeError(f"pipeline boundary: {what} has dtype {t.dtype}, want floating")
    if not bool(torch.isfinite(t).all()):
        raise FloatingPointError(f"pipeline boundary: {what} holds NaN/Inf; nothing was "
                                 "sent (a diverged step: lower the learning rate or clip)")


class _SendFn(torch.autograd.Function):
    """values (+ ids) -> forward message; backward: message -> gradient of values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ids: Optional[torch.Tensor],
                layout: BoundaryLayout, counter: "BoundaryCounter") -> torch.Tensor:
        ctx.layout, ctx.counter, ctx.dtype = layout, counter, x.dtype
        counter.add("forward", layout)
        return layout.pack_forward(x, ids)

    @staticmethod
    def backward(ctx: Any, g_msg: torch.Tensor) -> Tuple[Any, ...]:
        g = ctx.layout.unpack_backward(g_msg)
        return g.to(ctx.dtype), None, None, None


class _RecvFn(torch.autograd.Function):
    """forward message -> (values, ids); backward: gradient of values -> message."""

    @staticmethod
    def forward(ctx: Any, msg: torch.Tensor, layout: BoundaryLayout,
                counter: "BoundaryCounter") -> Tuple[torch.Tensor, torch.Tensor]:
        if msg.dtype != torch.float32 or tuple(msg.shape) != (layout.message_numel,):
            raise ValueError(f"pipeline boundary: received a {msg.dtype} message of shape "
                             f"{tuple(msg.shape)}, want float32 ({layout.message_numel},)")
        ctx.layout, ctx.counter = layout, counter
        x, ids = layout.unpack_forward(msg)
        # an empty id tensor where none travel: a Function's outputs are tensors
        ids = torch.empty(0, dtype=torch.int64, device=msg.device) if ids is None else ids
        ctx.mark_non_differentiable(ids)
        return x, ids

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_ids: Any) -> Tuple[Any, ...]:
        _check(g, ctx.layout.shape, "the gradient sent backward")
        ctx.counter.add("backward", ctx.layout)
        return ctx.layout.pack_backward(g), None, None


class BoundaryCounter:
    """Messages and bytes one stage sent over its boundaries (each way)."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {"forward_messages": 0, "forward_bytes": 0,
                                       "backward_messages": 0, "backward_bytes": 0}

    def add(self, leg: str, layout: BoundaryLayout) -> None:
        self.counts[f"{leg}_messages"] += 1
        self.counts[f"{leg}_bytes"] += layout.message_bytes


class BoundarySend(nn.Module):
    """The end of a stage: its boundary values (and ids) as one message.

    Args:
        layout: the boundary's layout (the next stage's :class:`BoundaryRecv` has the same).
        counter: where sent bytes are counted.
    """

    def __init__(self, layout: BoundaryLayout, counter: BoundaryCounter) -> None:
        super().__init__()
        self.layout, self.counter = layout, counter

    def forward(self, out: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        x, ids = (out if isinstance(out, tuple) else (out, None))
        _check(x, self.layout.shape, "the activation sent forward")
        if (ids is None) != (self.layout.ids_shape is None):
            raise ValueError("pipeline boundary: the stage's output and the layout disagree "
                             "on token ids (a subspace model needs subspace_k, and back)")
        if ids is not None and tuple(ids.shape) != self.layout.ids_shape:
            raise ValueError(f"pipeline boundary: token ids of shape {tuple(ids.shape)}, "
                             f"want {self.layout.ids_shape}")
        if not torch.is_grad_enabled() or not x.requires_grad:
            self.counter.add("forward", self.layout)
            return self.layout.pack_forward(x, ids)
        return _SendFn.apply(x, ids, self.layout, self.counter)


class BoundaryRecv(nn.Module):
    """The start of a stage: the previous stage's message decoded.

    Returns the values, or ``(values, ids)`` where ids travel (subspace).
    """

    def __init__(self, layout: BoundaryLayout, counter: BoundaryCounter) -> None:
        super().__init__()
        self.layout, self.counter = layout, counter

    def forward(self, msg: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        x, ids = _RecvFn.apply(msg, self.layout, self.counter)
        return x if self.layout.ids_shape is None else (x, ids)


class CompressedStage(nn.Module):
    """A stage's module between its boundaries: ``send(module(*recv(message)))``.

    Args:
        module: the user's stage module.  A middle or last stage's module takes the
            decoded values (subspace: values and ids); a first or middle stage's returns
            the values (subspace: ``(coefficients, ids)``).
        recv: the boundary in front (None on the first stage).
        send: the boundary behind (None on the last stage).
        layout: the boundaries' layout (every boundary of a pipeline has the same).
        counter: where the stage's boundaries count what they send.
    """

    def __init__(self, module: nn.Module, recv: Optional[BoundaryRecv],
                 send: Optional[BoundarySend], layout: BoundaryLayout,
                 counter: BoundaryCounter) -> None:
        super().__init__()
        self.module, self.recv, self.send = module, recv, send
        self.layout, self.counter = layout, counter

    def forward(self, *args: Any) -> Any:
        if self.recv is not None:
            if len(args) != 1:
                raise ValueError(f"a stage after a boundary takes one message, got "
                                 f"{len(args)} inputs")
            got = self.recv(args[0])
            args = got if isinstance(got, tuple) else (got,)
        out = self.module(*args)
        return self.send(out) if self.send is not None else out


class Subspace(nn.Module):
    """Protocol Models' fixed subspace and frozen embeddings, derived from a seed.

    ``U`` (width x k, orthonormal columns: Q of a Gaussian matrix's QR) is shared by
    every stage; so are the frozen random token and position tables that make the
    high-rank part ``x0`` of the residual stream.  All three are rebuilt from the
    seed on every rank (non-persistent buffers: a checkpoint does not carry them).

    Args:
        width: the residual stream's width d.
        k: the subspace's dimension, 1..d.
        vocab_size, block_size: rows of the frozen token and position tables.
        seed: :attr:`PipelineConfig.subspace_seed`.
        std: standard deviation of the frozen tables (GPT-2's embedding init, 0.02,
            so the stream starts at the scale the model was tuned for).
    """

    def __init__(self, width: int, k: int, vocab_size: int, block_size: int, seed: int,
                 std: float = 0.02) -> None:
        super().__init__()
        if not 0 < k <= width:
            raise ValueError(f"subspace_k must be in [1, {width}], got {k}")
        # a CPU generator of its own: the same U on every rank and device, whatever
        # the global RNG has done
        gen = torch.Generator().manual_seed(seed)
        u, _ = torch.linalg.qr(torch.randn(width, k, generator=gen, dtype=torch.float64))
        self.register_buffer("U", u.float().contiguous(), persistent=False)
        self.register_buffer("tok", torch.randn(vocab_size, width, generator=gen) * std,
                             persistent=False)
        self.register_buffer("pos", torch.randn(block_size, width, generator=gen) * std,
                             persistent=False)
        self.k = k

    def base(self, ids: torch.Tensor) -> torch.Tensor:
        """``x0``: the frozen high-rank part of the stream for token ids (B, T)."""
        return self.tok[ids] + self.pos[: ids.shape[-1]]

    def expand(self, x0: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x0 + U c`` (c: (..., k))."""
        return x0 + c @ self.U.t()


def pipeline_stage(module: nn.Module, stage_index: int, num_stages: int,
                   device: torch.device, cfg: PipelineConfig, *,
                   boundary_shape: Sequence[int], input_example: Optional[torch.Tensor] = None,
                   vocab_size: int = 0, group: Any = None,
                   counter: Optional[BoundaryCounter] = None) -> Any:
    """A ``torch.distributed.pipelining.PipelineStage`` whose boundaries are coded.

    Every boundary carries ``boundary_shape`` per microbatch (``(mb, T, d)``, or
    ``(mb, T, k)`` with ``cfg.subspace_k``, when the token ids ``(mb, T)`` travel
    too).  The stage's input and output metadata are given statically: the first
    stage's from ``input_example``, the boundaries' from the layout, the last stage's
    output from one forward of its module on a zeroed message (valid values and ids,
    unlike the uninitialised buffers torch's shape inference runs on).

    Memory: one message per microbatch in flight and direction, ``message_bytes``
    (``BoundaryLayout``): for int8 about a quarter of the fp32 activation.

    Args:
        module: this stage's module (see :class:`CompressedStage`).
        stage_index, num_stages, device, group: as ``PipelineStage``.
        cfg: the codes.
        boundary_shape: per-microbatch shape of the values crossing every boundary.
        input_example: the first stage's input for one microbatch (required there).
        vocab_size: required with ``cfg.subspace_k`` (the ids' size on the wire).
        counter: where the stage counts the bytes it sends (a new one if None);
            also reachable as ``stage.submod.counter``.
    Returns:
        the ``PipelineStage``; its ``submod`` is the :class:`CompressedStage`.
    """
    from torch.distributed.pipelining import PipelineStage

    require_codec()
    if not 0 <= stage_index < num_stages or num_stages < 2:
        raise ValueError(f"stage {stage_index} of {num_stages}: need 0 <= stage < stages, "
                         "stages >= 2")
    shape = tuple(int(s) for s in boundary_shape)
    if cfg.subspace_k and shape[-1] != cfg.subspace_k:
        raise ValueError(f"subspace_k {cfg.subspace_k}: the boundary must be (..., k), got "
                         f"{shape}")
    ids_shape = shape[:-1] if cfg.subspace_k else None
    layout = BoundaryLayout(shape, cfg, ids_shape, vocab_size)
    counter = counter or BoundaryCounter()
    first, last = stage_index == 0, stage_index == num_stages - 1
    recv = None if first else BoundaryRecv(layout, counter)
    send = None if last else BoundarySend(layout, counter)
    wrapped = CompressedStage(module, recv, send, layout, counter)
    if first:
        if input_example is None:
            raise ValueError("the first stage needs input_example (one microbatch)")
        inputs: Tuple[torch.Tensor, ...] = (input_example.to(device),)
    else:
        # the metadata's requires_grad is what makes the pipeline send a gradient back
        inputs = (layout.empty_message(device).requires_grad_(),)
    if last:
        x, ids = layout.unpack_forward(layout.empty_message(device))
        with torch.no_grad():
            out = module(*((x,) if ids is None else (x, ids)))
        outputs: Any = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
    else:
        outputs = layout.empty_message(device).requires_grad_()
    logger.info("pipeline stage %d/%d: boundary %s, %s forward / %s backward, message %d "
                "bytes", stage_index, num_stages, shape, cfg.format, cfg.grad_format,
                layout.message_bytes)
    return PipelineStage(wrapped, stage_index, num_stages, device, input_args=inputs,
                         output_args=outputs, group=group)
