"""Custom HSDP on the CPU: the all-reduce between nodes overlapped with the backward.

On a GPU, FSDP2 calls the all-reduce hook with its all-reduce stream current and the
hook only enqueues work, so the backward goes on while a unit's gradients travel.  On
the CPU there are no streams: FSDP2 calls the hook on the thread running the backward,
and a hook that blocks stalls the backward for the whole exchange.  So on the CPU
(``hsdp_overlap``) the hook hands each unit's all-reduce to :class:`Overlap`, one worker
thread per registered model, and returns at once; the backward computes the next unit
meanwhile.

Why that is safe (torch 2.13, ``_fsdp_collectives.foreach_reduce``): after the hook
returns, FSDP only views the hook's tensor as the parameters' ``.grad`` (no read, no
copy) when (a) no ``.grad`` is there to accumulate into, (b) the reduce dtype is the
parameters' own (no cast into a new tensor), (c) the gradient is not offloaded and (d)
no post-accumulate-grad hook reads it; FSDP's divide after the hook is a no-op (TAGC
sets FSDP's divide factors so, and divides in the hook: tagc/hsdp.py ``install``).  :func:`deferrable` checks (a)-(d) on
every call; a call that fails them first waits for every deferred unit, then runs on
the calling thread.  Nothing may read a gradient before its exchange ends: the first
deferred call of a backward queues :meth:`Overlap.wait` as an autograd final callback,
which runs after FSDP's own (the root unit's reduction, made there, included), so
``loss.backward()`` returns with every gradient summed over the replicas, exactly as
with a blocking hook (same operations, same order: bit for bit the same values).

Order: each rank's worker runs the units' exchanges in the order FSDP called the hooks,
the same on every rank (the same model and backward), so the replicate group's
collectives match across ranks as they do with a blocking hook; while units are in
flight only the worker issues collectives on that group.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from . import fsdp2

logger = logging.getLogger(__name__)

# the running backward's graph task id (-1 outside a backward); a private torch API,
# present in torch 2.13: without it nothing is deferred
_graph_task_id: Optional[Callable[[], int]] = getattr(torch._C, "_current_graph_task_id", None)


def deferrable(t: torch.Tensor, params: Iterable[Any]) -> bool:
    """Whether FSDP leaves the hook's tensor alone until the backward ends.

    Args:
        t: the hook's tensor (FSDP2's reduce-scatter output).
        params: the unit's ``FSDPParam``s.
    Returns:
        True when the all-reduce of ``t`` may finish after the hook returns: a CPU
        tensor inside a backward, and no parameter of the unit accumulates into an
        existing ``.grad``, casts to another dtype, offloads, or has a
        post-accumulate-grad hook (each of which reads ``t`` right after the hook).
    """
    if t.is_cuda or _graph_task_id is None or _graph_task_id() < 0:
        return False
    return fsdp2.output_left_alone(list(params), t.dtype)


class Overlap:
    """A worker thread running deferred units' all-reduces in submission order.

    :meth:`wait` returns when every submitted unit is done and raises the first
    error any of them raised (the later units still ran: their collectives must
    match the peers', which fail alike).

    Attributes:
        deferred: units run on the worker so far (a counter for stats and tests).
    """

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # the backward (graph task) whose final callback waits for the worker
        self._task: Optional[int] = None
        self.deferred = 0

    @property
    def pending(self) -> int:
        """Units submitted and not yet done."""
        with self._done:
            return self._pending

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker after every earlier one; the running backward
        waits for it before it returns.  Call only where :func:`deferrable` holds
        (inside a backward)."""
        task = _graph_task_id() if _graph_task_id is not None else -1
        if task < 0:
            raise RuntimeError("TAGC: Overlap.submit outside a backward; nothing would "
                               "wait for the all-reduce")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tagc-overlap",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)
        with self._done:
            self._pending += 1
            self.deferred += 1
        self._jobs.put(job)
        if task != self._task:
            # final callbacks queued from a hook, even one FSDP calls from its own
            # final callback, run after the callbacks queued before them
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            self._task = task

    def wait(self) -> None:
        """Block until every submitted unit is done.

        Raises:
            RuntimeError: a unit's all-reduce failed (chained to its error).
        """
        with self._done:
            while self._pending:
                self._done.wait()
            self._task = None
            err, self._error = self._error, None
        if err is not None:
            raise RuntimeError("TAGC: an overlapped HSDP all-reduce failed") from err

    def close(self, timeout: float = 10.0) -> None:
        """End the worker after the units already submitted (idempotent; at exit too).

        Args:
            timeout: seconds to wait for them.  A normal program has none in flight
                here (every backward waits for its own); after an error a unit may
                be stuck in a collective with a peer that is gone, and the exit must
                not hang on it (the worker is a daemon thread).
        """
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("TAGC: %d overlapped HSDP all-reduce(s) still running after "
                           "%.0f s; leaving them", self.pending, timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                with self._done:
                    if self._error is None:
                        self._error = e
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()
