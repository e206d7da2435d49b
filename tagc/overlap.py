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

Failures: a job that raises stops the worker.  Each rank's collectives pair with its
peers' by their order alone, so after one rank's job failed (a Python error before its
collective, a peer gone, a collective timed out) its later collectives would meet the
peers' wrong ones: the worker runs no job after the first failure, marking each failed
("not run: an earlier overlapped X failed"), and every later :meth:`Overlap.submit`,
:meth:`Overlap.run` or wait raises on the training thread, chained to the first error,
a failed gather that nobody waits for included.  Nothing waits without a bound: a
gloo or NCCL collective fails by itself after its process group's timeout (the
training script's ``--timeout``), and a wait for the worker gives up once no job has
finished for :attr:`Overlap.timeout` seconds (by default twice the default process
group's timeout: the backstop for a job stuck outside a collective), stopping the
worker as a failure does.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# the running backward's graph task id (-1 outside a backward); a private torch API,
# present in torch 2.13: without it nothing is deferred
_graph_task_id: Optional[Callable[[], int]] = getattr(torch._C, "_current_graph_task_id", None)

# a wait's default bound in process group timeouts: a job's collectives each fail by
# themselves after one, so a job running for two is stuck outside them, or its link is
# too slow for the timeout the run was given
STALL_TIMEOUTS = 2.0


def in_backward() -> bool:
    """Whether the calling thread runs a backward (a graph task is current)."""
    return _graph_task_id is not None and _graph_task_id() >= 0


def group_timeout() -> float:
    """The default process group's collective timeout in seconds (``init_process_group``'s
    ``timeout``, the training script's ``--timeout``); torch's default for gloo (30
    minutes) without a group.

    Returns:
        seconds.
    """
    default = dist.constants.default_pg_timeout.total_seconds()
    if not dist.is_available() or not dist.is_initialized():
        return default
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):  # private torch API; no CPU backend
        return default


def _seconds(timeout: Union[None, float, datetime.timedelta]) -> Optional[float]:
    """A wait's bound in seconds, None for none: torch's ``Work.wait`` takes a
    ``timedelta`` whose zero means no bound of the call's own."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


def _not_run(failed: str, failure: BaseException) -> RuntimeError:
    """The error of a job the worker skipped after ``failure`` (of a ``failed``),
    chained to it."""
    err = RuntimeError(f"not run: an earlier overlapped {failed} failed: {failure}")
    err.__cause__ = failure
    return err


class _Job:
    """One submitted exchange: ``fn``, then ``done`` set; ``error`` what it raised, or
    why it was not run; ``what`` names it in errors."""

    __slots__ = ("fn", "what", "done", "error")

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self.fn, self.what = fn, what
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class JobWork(dist.Work):
    """The ``torch.distributed.Work`` a comm returns for a job on the worker: FSDP2
    (``foreach_all_gather_copy_out``) calls :meth:`wait` before it reads the output.

    Args:
        job: the job.
        overlap: the worker that runs it.
    """

    def __init__(self, job: _Job, overlap: "Overlap") -> None:
        super().__init__()
        self._job, self._overlap = job, overlap

    def is_completed(self) -> bool:
        return self._job.done.is_set()

    def wait(self, timeout: Union[None, float, datetime.timedelta] = None) -> bool:
        """Block until the job ran (idempotent).

        Args:
            timeout: at most this long (a ``timedelta`` as torch's ``Work.wait`` takes,
                or seconds); None or zero: until the worker has finished no job for
                :attr:`Overlap.timeout`.
        Returns:
            True.
        Raises:
            RuntimeError: the job failed or was not run (chained to its error), the
                worker stopped before it ran (chained to the first failure), or the
                wait timed out (which stops the worker).  A job that ran before a
                failure returns: its output is good, and the next call raises.
        """
        job = self._job
        self._overlap._await(job.done.is_set, job.what, _seconds(timeout))
        if not job.done.is_set():  # behind a failure: skipped soon, or stuck behind it
            self._overlap._check()
        if job.error is not None:
            raise RuntimeError(f"TAGC: an overlapped {job.what} failed: {job.error}") \
                from job.error
        return True


class Overlap:
    """A worker thread running a model's exchanges in submission order.

    :meth:`submit` defers a gradient exchange to the end of the running backward;
    :meth:`run` hands one over and returns a :class:`JobWork` to wait on.
    :meth:`wait` returns when every submitted job is done.  The first job that fails
    stops the worker (module docstring): no later job runs, and every later
    :meth:`submit`, :meth:`run` and wait raises, chained to that first error.

    Args:
        what: the deferred exchanges, for errors ("HSDP all-reduce", ...).
        timeout: seconds a wait goes on while the worker finishes no job before it
            raises and stops the worker; None: :data:`STALL_TIMEOUTS` times the default
            process group's timeout (:func:`group_timeout`), read at each wait.

    Attributes:
        deferred: gradient exchanges deferred so far (a counter for stats and tests).
        handed: jobs :meth:`run` handed over so far.
    """

    def __init__(self, what: str = "HSDP all-reduce", timeout: Optional[float] = None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"Overlap: timeout must be > 0 seconds or None (twice the "
                             f"process group's), got {timeout}")
        self.what = what
        self._timeout = timeout
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._done = threading.Condition()
        self._pending = 0
        # the first failure and the job it failed; once set, no job runs
        self._failure: Optional[BaseException] = None
        self._failed: str = ""
        # when the worker last started or finished a job (time.monotonic)
        self._progress = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        # the backward (graph task) whose final callback waits for the worker
        self._task: Optional[int] = None
        self.deferred = 0
        self.handed = 0

    @property
    def timeout(self) -> float:
        """Seconds a wait goes on while the worker finishes no job (the default read
        from the process group now)."""
        if self._timeout is not None:
            return self._timeout
        return STALL_TIMEOUTS * group_timeout()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet done."""
        with self._done:
            return self._pending

    @property
    def failed(self) -> bool:
        """Whether a job failed (or a wait timed out): the worker runs no more jobs."""
        with self._done:
            return self._failure is not None

    def _put(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tagc-overlap",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)
        with self._done:
            self._pending += 1
        self._jobs.put(job)

    def _check(self) -> None:
        """Raise the first failure, if a job failed: the training thread's next call.

        Raises:
            RuntimeError: naming the failed job and the fix, chained to its error.
        """
        with self._done:
            err, what = self._failure, self._failed
        if err is not None:
            raise RuntimeError(
                f"TAGC: an overlapped {what} failed: {err}; the overlapped exchanges "
                f"stopped there (later ones would pair with the wrong collectives of the "
                f"other ranks): end the run on every rank and resume it from its last "
                f"checkpoint") from err

    def _stop(self, err: BaseException, what: str) -> None:
        """Record ``err`` as the failure that stops the worker, unless one came first."""
        with self._done:
            if self._failure is None:
                self._failure, self._failed = err, what

    def _await(self, ready: Callable[[], bool], what: str, timeout: Optional[float]) -> None:
        """Block until ``ready()`` or a failure.

        Args:
            ready: the condition (read under the worker's lock).
            what: the exchange waited for, for the error.
            timeout: seconds from now; None: until the worker has finished no job for
                :attr:`timeout` seconds.
        Raises:
            RuntimeError: the bound passed (the worker is stopped: its next job must
                not pair with the peers' collectives after this rank gave up).
        """
        stall = timeout is None
        bound = self.timeout if stall else float(timeout)  # type: ignore[arg-type]
        start = time.monotonic()
        with self._done:
            while not ready() and self._failure is None:
                since = max(start, self._progress) if stall else start
                left = since + bound - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(left)
            else:
                return
        why = (f"the worker finished no job for {bound:g} s (Overlap.timeout: "
               f"{STALL_TIMEOUTS:g} x the process group's timeout unless set)" if stall
               else f"the wait's timeout of {bound:g} s")
        err = RuntimeError(f"TAGC: timed out waiting for an overlapped {what}: {why}; a "
                           f"peer may be stopped or gone, or the link too slow for the "
                           f"timeout: raise --timeout (the process group's) if the peers "
                           f"are alive")
        self._stop(err, what)
        raise err

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker after every earlier one; the running backward
        waits for it before it returns.  Call only where :func:`tagc.fsdp2.deferrable` holds
        (inside a backward).

        Raises:
            RuntimeError: outside a backward, or an earlier job failed (:meth:`_check`).
        """
        task = _graph_task_id() if _graph_task_id is not None else -1
        if task < 0:
            raise RuntimeError(f"TAGC: Overlap.submit outside a backward; nothing would "
                               f"wait for the {self.what}")
        self._check()
        self.deferred += 1
        self._put(_Job(job, self.what))
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
        Raises:
            RuntimeError: an earlier job failed (:meth:`_check`).
        """
        self._check()
        j = _Job(job, what)
        self.handed += 1
        self._put(j)
        return JobWork(j, self)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every submitted job is done.

        Args:
            timeout: at most this many seconds; None: until the worker has finished no
                job for :attr:`timeout` seconds.
        Raises:
            RuntimeError: a job failed, a gather nobody waited for included (chained
                to its error), or the wait timed out (which stops the worker).
        """
        try:
            self._await(lambda: self._pending == 0, self.what, _seconds(timeout))
        finally:
            with self._done:
                self._task = None
        self._check()

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
            with self._done:
                failure, failed = self._failure, self._failed
                self._progress = time.monotonic()
            if failure is not None:
                # the peers' collectives no longer line up with this rank's
                job.error = _not_run(failed, failure)
            else:
                try:
                    job.fn()
                except BaseException as e:  # noqa: BLE001 - raised on the training thread
                    job.error = e
            if self._finish(job):
                return

    def _finish(self, job: _Job) -> bool:
        """Mark ``job`` done, recording its error as the first failure if it is; after
        a failure, mark every job queued behind it not run at once, so that a wait
        that raises leaves none in flight (unless one is stuck in its collective).

        Returns:
            whether :meth:`close` asked the worker to end meanwhile.
        """
        closing = False
        with self._done:
            if job.error is not None and self._failure is None:
                self._failure, self._failed = job.error, job.what
            done = [job]
            while self._failure is not None:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    closing = True
                    continue
                nxt.error = _not_run(self._failed, self._failure)
                done.append(nxt)
            for j in done:
                j.fn = None  # type: ignore[assignment]  # drop the tensors it holds
                j.done.set()
            self._pending -= len(done)
            self._progress = time.monotonic()
            self._done.notify_all()
        return closing
