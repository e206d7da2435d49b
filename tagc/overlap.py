"""TAGC's collectives on the CPU, overlapped with compute on a worker thread.

On a GPU FSDP2 runs its collectives on their own streams: the reduce-scatter (or the
all-reduce hook) and the next unit's all-gather only enqueue work, so the forward and
backward go on while a unit's bytes travel.  On the CPU there are no streams: FSDP2
calls the comms on the thread running the model, and a comm that blocks stalls the
compute for the whole exchange.  So on the CPU TAGC hands its exchanges to
:class:`Overlap`, one worker thread per registered model, and returns at once:

- custom HSDP (``hsdp_overlap``): each unit's all-reduce between the nodes
  (tagc/hsdp.py ``Hook``);
- FSDP2 over one group (``fsdp_overlap``): each unit's reduce-scatter
  (tagc/fsdp2.py ``ReduceScatterComm``) and every parameter all-gather
  (tagc/gather.py), which FSDP waits for through the :class:`JobWork` the comm
  returns; FSDP's backward prefetch and the forward prefetch TAGC sets
  (:class:`tagc.fsdp2.ForwardOrder`) issue each gather one unit ahead of its compute.

Why deferring a gradient exchange is safe (torch 2.13,
``_fsdp_collectives.foreach_reduce``): after the comm returns, FSDP only views its
output as the parameters' ``.grad`` (no read, no copy) when (a) no ``.grad`` is there
to accumulate into, (b) the reduce dtype is the parameters' own (no cast into a new
tensor), (c) the gradient is not offloaded and (d) no post-accumulate-grad hook reads
it; FSDP's divide after the comm is a no-op (TAGC sets FSDP's divide factors so and
divides itself: :func:`tagc.fsdp2.sum_reductions`).  :func:`tagc.fsdp2.deferrable` checks (a)-(d)
on every call; a call that fails them runs on the worker too (after every unit before
it: the order below) and the comm waits for it.  Nothing may read a gradient before its
exchange ends: the first deferred call of a backward queues :meth:`Overlap.wait` as an
autograd final callback, which runs after FSDP's own (the root unit's reduction, made
there, included), so ``loss.backward()`` returns with every gradient reduced, exactly
as with a blocking comm (same operations, same order: bit for bit the same values).

Order: each rank's worker runs the jobs in the order the model submitted them, the
same on every rank (the same model, forward and backward), so the group's collectives
match across ranks as they do when they block; while jobs are in flight only the
worker issues collectives on that group.  That is why ``fsdp_overlap`` routes *every*
all-gather of the group through the worker, exact ones included (:class:`tagc.gather.
OrderedGatherComm` without ``gather``), and why the HSDP route keeps its gathers on the
calling thread (FSDP's own reduce-scatter uses their group there).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# the running backward's graph task id (-1 outside a backward); a private torch API,
# present in torch 2.13: without it nothing is deferred
_graph_task_id: Optional[Callable[[], int]] = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether the calling thread runs a backward (a graph task is current)."""
    return _graph_task_id is not None and _graph_task_id() >= 0


class _Job:
    """One submitted exchange: ``fn``, then ``done`` set; ``error`` what it raised.
    ``owned``: a :class:`JobWork` reports the error (a gather), else
    :meth:`Overlap.wait` does (a deferred gradient exchange)."""

    __slots__ = ("fn", "owned", "done", "error")

    def __init__(self, fn: Callable[[], None], owned: bool) -> None:
        self.fn, self.owned = fn, owned
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class JobWork(dist.Work):
    """The ``torch.distributed.Work`` a comm returns for a job on the worker: FSDP2
    (``foreach_all_gather_copy_out``) calls :meth:`wait` before it reads the output.

    Args:
        job: the job.
        what: what the job does (the error message).
    """

    def __init__(self, job: _Job, what: str) -> None:
        super().__init__()
        self._job, self._what = job, what

    def is_completed(self) -> bool:
        return self._job.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the job ran (idempotent).

        Raises:
            RuntimeError: it failed (chained to its error).
        """
        self._job.done.wait()
        if self._job.error is not None:
            raise RuntimeError(f"TAGC: an overlapped {self._what} failed") from self._job.error
        return True


class Overlap:
    """A worker thread running a model's exchanges in submission order.

    :meth:`submit` defers a gradient exchange to the end of the running backward;
    :meth:`run` hands one over and returns a :class:`JobWork` to wait on.
    :meth:`wait` returns when every submitted job is done and raises the first error
    a deferred one raised (the later jobs still ran: their collectives must match the
    peers', which fail alike).

    Args:
        what: the deferred exchanges, for errors ("HSDP all-reduce", ...).

    Attributes:
        deferred: gradient exchanges deferred so far (a counter for stats and tests).
        handed: jobs :meth:`run` handed over so far.
    """

    def __init__(self, what: str = "HSDP all-reduce") -> None:
        self.what = what
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # the backward (graph task) whose final callback waits for the worker
        self._task: Optional[int] = None
        self.deferred = 0
        self.handed = 0

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet done."""
        with self._done:
            return self._pending

    def _put(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tagc-overlap",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)
        with self._done:
            self._pending += 1
        self._jobs.put(job)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker after every earlier one; the running backward
        waits for it before it returns.  Call only where :func:`tagc.fsdp2.deferrable` holds
        (inside a backward)."""
        task = _graph_task_id() if _graph_task_id is not None else -1
        if task < 0:
            raise RuntimeError(f"TAGC: Overlap.submit outside a backward; nothing would "
                               f"wait for the {self.what}")
        self.deferred += 1
        self._put(_Job(job, owned=False))
        if task != self._task:
            # final callbacks queued from a hook, even one FSDP calls from its own
            # final callback, run after the callbacks queued before them
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            self._task = task

    def run(self, job: Callable[[], None], what: str) -> JobWork:
        """Run ``job`` on the worker after every earlier one.

        Args:
            job: the exchange.
            what: what it does, for its error.
        Returns:
            the work to wait on before reading what ``job`` writes.
        """
        j = _Job(job, owned=True)
        self.handed += 1
        self._put(j)
        return JobWork(j, what)

    def wait(self) -> None:
        """Block until every submitted job is done.

        Raises:
            RuntimeError: a deferred exchange failed (chained to its error).
        """
        with self._done:
            while self._pending:
                self._done.wait()
            self._task = None
            err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"TAGC: an overlapped {self.what} failed") from err

    def close(self, timeout: float = 10.0) -> None:
        """End the worker after the jobs already submitted (idempotent; at exit too).

        Args:
            timeout: seconds to wait for them.  A normal program has none in flight
                here (every backward waits for its own); after an error a job may
                be stuck in a collective with a peer that is gone, and the exit must
                not hang on it (the worker is a daemon thread).
        """
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("TAGC: %d overlapped exchange(s) still running after %.0f s; "
                           "leaving them", self.pending, timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to wait() / JobWork
                job.error = e
                if not job.owned:
                    with self._done:
                        if self._error is None:
                            self._error = e
            finally:
                job.fn = None  # type: ignore[assignment]  # drop the tensors it holds
                job.done.set()
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()
