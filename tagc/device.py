"""Where one reduction runs: the CPU/CUDA decision, made once per call (:class:`Exec`).

On the CPU everything is synchronous and scalar results are Python numbers.  On CUDA
the codec runs on a side stream per device (:class:`CodecStreams`), scalar results stay
in 1-element device tensors, collectives are issued async and waited on by the codec
stream, and data-dependent decisions never reach the host (:func:`gate`,
:func:`poison_nonfinite`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch


def gate(value: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``value`` where ``ok``, else 0, without reading ``ok`` on the host.

    Args:
        value: any tensor.
        ok: bool tensor broadcastable to ``value`` (1 element: the call's
            "every rank's gradient is finite" flag).
    Returns:
        a new tensor; ``torch.where`` selects, so NaN/Inf in ``value`` do not
        leak through a False ``ok`` (a product ``value * ok`` would give NaN).
    """
    return torch.where(ok, value, torch.zeros_like(value))


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds a NaN or an Inf, as a 0-dim bool tensor on ``t``'s device.

    One pass of a sum instead of ``~isfinite(t).all()`` (a bool tensor of ``t``'s
    size, then a reduction: about 30x slower on the CPU, where it was a tenth of an
    HSDP step's host time): any NaN or Inf makes the sum NaN or Inf, so nothing
    non-finite passes.  The sum runs in float32 (float64 for float64 ``t``), so
    float16 values cannot overflow it; a bfloat16/float32 gradient whose
    magnitudes sum past 3.4e38 (float64: 1.8e308) is called non-finite too and
    takes the plain path, which is always correct.

    Args:
        t: a floating tensor.
    Returns:
        the flag.
    """
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return ~torch.isfinite(t.sum(dtype=acc))


def nonfinite_vote(t: torch.Tensor) -> torch.Tensor:
    """This rank's vote on whether ``t`` is finite, for a SUM all-reduce (CUDA).

    A 1-element tensor, 0 when :func:`nonfinite` would say finite, NaN otherwise
    (``s - s`` of the sum ``s``: 0 for a finite ``s``, NaN for an infinite or NaN one).
    NaN absorbs the sum, so the ranks' votes add up to 0 exactly when every rank's
    gradient is finite; two kernels (the sum, the difference) where ``nonfinite`` and a
    cast take six on a GPU, whose host enqueues each (docs/gpu).

    Args:
        t: a floating tensor.
    Returns:
        the vote (float32; float64 for float64 ``t``).
    """
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    s = t.sum(dtype=acc).reshape(1)
    return s.sub_(s)


def poison_nonfinite(grad2d: torch.Tensor, bad: torch.Tensor) -> None:
    """If ``bad``, write NaN into element 0 of every shard (row) of ``grad2d``, in place.

    The sync-free form of the non-finite fallback (CUDA): when any rank's
    gradient holds NaN/Inf, every rank poisons every shard, so every encoder
    sees NaN and, by its CUDA contract (cuda/tagc_cuda.h), leaves the
    residual untouched and sends NaN that reaches every owner's decoded
    shard, where GradScaler finds it.  When ``bad`` is False the rows are
    rewritten with their own values (no change).

    Args:
        grad2d: ``(N, S)`` view of the unit gradient: FSDP's scratch buffer,
            which FSDP drops after the reduce-scatter (FSDP1's default path
            pre-divides it in place too).
        bad: 1-element bool tensor on the same device.
    """
    col = grad2d[:, 0]
    col.copy_(torch.where(bad, torch.full_like(col, float("nan")), col))


class Scratch:
    """CPU buffers a model's reducers reuse from call to call, one per name and dtype.

    Why: a fresh CPU tensor is fresh pages.  glibc serves blocks above 32 MiB with
    ``mmap`` and hands them back on free, so a unit's shard-sized buffers were faulted
    in, page by page, on every call (34 MB fresh and filled: 15 ms against 1.5 ms
    reused, 8230 faults, on this machine), and so were the receive buffers gloo's
    threads write into; an HSDP step of the benchmark model took 20-35 thousand more
    page faults than native HSDP's (docs/RESULTS.md).  A buffer here is faulted in
    once and kept: at most the largest request of each name, about two fp32 shards of
    the largest unit and their codes per model.  CUDA tensors never come from here
    (the caching allocator already keeps blocks, and streams would need events).

    Reuse is safe because a model's units are reduced one at a time (FSDP calls the
    hooks in turn; the ``hsdp_overlap`` / ``fsdp_overlap`` worker runs them in turn,
    and a call that must block waits for it first or runs on it) and a buffer never
    outlives the call that took it.
    """

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor, as ``torch.empty``; on the CPU a view of the
        buffer ``name`` (grown when too small), valid until the next request of
        ``name``.

        Args:
            name: the buffer (distinct for buffers a call uses at the same time).
            shape: the tensor's shape.
            dtype: its dtype.
            device: its device.
        Returns:
            the tensor.
        """
        if torch.device(device).type != "cpu":
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        n = math.prod(int(d) for d in shape)
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(tuple(shape))

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class Exec:
    """The device side of one call, decided once from its input tensor.

    Attributes:
        cuda: the call's tensors are CUDA tensors.
        kw: keyword arguments every ``_tagc`` call takes here (the codec
            stream on CUDA; the reducer makes that stream current first).
        ok: CUDA only: the call's "every rank finite" device flag once agreed
            (gates device counters and feedback updates); None on the CPU.
        vote: CUDA only, the unit path: the ranks' summed finite votes (0: every
            rank finite), which its encoder reads instead of ``ok``; else None.
        scratch: the model's reused CPU buffers (None: fresh tensors).
    """

    def __init__(self, t: torch.Tensor, scratch: Optional[Scratch] = None) -> None:
        self.cuda = t.is_cuda
        self.scratch = scratch
        self.kw: Dict[str, int] = (
            {"stream": torch.cuda.current_stream(t.device).cuda_stream} if self.cuda else {})
        self.ok: Optional[torch.Tensor] = None
        self.vote: Optional[torch.Tensor] = None

    def count(self, fn: Callable[..., Any], *args: Any, out_kw: str = "out",
              **kw: Any) -> Union[int, torch.Tensor]:
        """Call a ``_tagc`` function that returns a count.

        Returns:
            on the CPU the count as an int; on CUDA a 1-element int64 device
            tensor (reading it would be a host sync; it feeds UnitStats.add).
        """
        if self.cuda:
            o = torch.empty(1, dtype=torch.int64, device=args[0].device)
            fn(*args, **{out_kw: o}, **kw, **self.kw)
            return o
        return int(fn(*args, **kw, **self.kw))

    def issue(self, async_op: bool, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Issue one torch.distributed collective.

        On the CPU exactly ``fn(..., async_op=async_op)``.  On CUDA always
        async: a caller that wants the result now gets ``work.wait()`` called
        here, with the codec stream current, which for NCCL makes that stream
        wait for the collective (a stream wait, not a host wait).

        Returns:
            the work object if ``async_op``, else None.
        """
        if not self.cuda:
            return fn(*args, async_op=async_op, **kw)
        work = fn(*args, async_op=True, **kw)
        if async_op:
            return work
        work.wait()
        return None

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """A buffer for this call only (:meth:`Scratch.empty`)."""
        if self.scratch is None:
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        return self.scratch.empty(name, shape, dtype, device)

    def keep(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` unless this call's gradients were not finite on some rank
        (CUDA; a CPU call with non-finite values never gets this far)."""
        return new if self.ok is None else torch.where(self.ok, new, old)


class CodecStreams:
    """What the reducers of a model share on the device: one codec stream per CUDA
    device, and the reused CPU buffers (:attr:`scratch`)."""

    def __init__(self) -> None:
        self._streams: Dict[int, Any] = {}
        self._flags: Dict[torch.device, torch.Tensor] = {}
        # per thread and device, the two events around() records and waits on
        self._events = threading.local()
        self.scratch = Scratch()

    def get(self, device: torch.device) -> "torch.cuda.Stream":
        """The codec stream of ``device`` (created on first use)."""
        key = torch.device(device).index
        if key is None:
            key = torch.cuda.current_device()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=key)
        return stream

    def flags(self, device: torch.device) -> torch.Tensor:
        """The unit path's device words of ``device``, a tensor's device
        (``_tagc.quant_unit_encode``'s ``flags``: int32[2], zero between calls, which the
        kernels leave as they found them).  One per device serves every unit: they all
        encode on its codec stream, one call after another."""
        key = torch.device(device)  # a tensor's device: its index is set
        t = self._flags.get(key)
        if t is None:
            t = self._flags[key] = torch.zeros(2, dtype=torch.int32, device=key)
        return t

    @contextlib.contextmanager
    def around(self, *foreign: torch.Tensor) -> Iterator[None]:
        """Run the body on the codec stream S of the tensors' device, ordered after the
        caller's current stream R's work so far (S waits for an event recorded on R) and
        before R's later work (R waits for one recorded on S, also when the body raises:
        FSDP records its events on R right after the call returns).  ``foreign`` tensors belong to R's
        allocator and are ``record_stream``-ed on S; the body allocates on S.

        Args:
            foreign: the CUDA tensors handed in by FSDP (at least one; the first names
                the device).
        """
        device = foreign[0].device
        r_stream = torch.cuda.current_stream(device)
        s_stream = self.get(device)
        ready, done = self._event_pair(device)
        ready.record(r_stream)
        s_stream.wait_event(ready)
        for t in foreign:
            t.record_stream(s_stream)
        try:
            with torch.cuda.stream(s_stream):
                yield
        finally:
            done.record(s_stream)
            r_stream.wait_event(done)

    def _event_pair(self, device: torch.device) -> Tuple[Any, Any]:
        """This thread's two events of ``device`` for :meth:`around`, made once:
        ``Stream.wait_stream`` makes (and later destroys) a CUDA event per call.  A
        re-recorded event is safe to reuse: a stream waits for the record that was the
        latest when the wait was enqueued.  Per thread, so that an overlap worker's
        record never lands between another thread's record and wait."""
        pairs = getattr(self._events, "pairs", None)
        if pairs is None:
            pairs = self._events.pairs = {}
        pair = pairs.get(device)
        if pair is None:
            pair = pairs[device] = (torch.cuda.Event(), torch.cuda.Event())
        return pair

    def join(self) -> None:
        """Order the caller's current stream after all codec work (before host reads)."""
        for key, stream in self._streams.items():
            torch.cuda.current_stream(key).wait_stream(stream)
