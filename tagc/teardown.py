"""Exit safety on gloo: let torch's gloo workers finish with Python before it finalizes.

The abort some 2-rank gloo runs died of at exit ("terminate called without an active
exception", SIGABRT), with or without TAGC, has this cause (core dump, torch 2.13,
CPython 3.11; ``tests/teardown_repro.py`` shows it with plain ``torch.distributed``):

1. ``dist.destroy_process_group()`` forgets a group, but its C++ ``ProcessGroupGloo``
   and its two worker threads (``pt_gloo_runloop``) live on while anything else holds
   it: an FSDP module, a device mesh, a hook's state.
2. A worker drops its last reference to a finished collective *after* the main thread
   got the result (``runLoop``: execute, then reset).  When the Python side has already
   dropped a tensor of that collective, torch made the tensor own its Python object, so
   that last drop takes the GIL (``TensorImpl::decref_pyobject``).
3. If the main thread has meanwhile begun finalizing the interpreter, CPython 3.11
   answers a foreign thread's GIL request with ``pthread_exit``; its forced unwind
   meets a ``noexcept`` destructor and the C++ runtime calls ``std::terminate``.

So the race is a worker's last reference against the end of the program: rare for a
collective that was waited for (microseconds, unless the scheduler parks the worker
in between, as on a loaded machine), certain for one still in flight.  A library
cannot close it inside torch; :func:`drain` closes it from outside by holding the
program at exit, the GIL released, until every gloo worker is parked, and
:func:`install` runs it at exit.  ``register()`` installs it; plain torch programs can
call :func:`install` too.  Linux only (it reads ``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Dict, Tuple

logger = logging.getLogger(__name__)

__all__ = ["drain", "gloo_workers", "install"]

# the name torch gives ProcessGroupGloo's worker threads (c10::setThreadName)
WORKER_THREAD = "pt_gloo_runloop"
_TASKS = "/proc/self/task"
_installed = False


def gloo_workers() -> Dict[int, Tuple[str, int]]:
    """This process's gloo worker threads.

    Returns:
        thread id -> (scheduler state letter, context switches so far); empty when
        there are none or ``/proc`` cannot be read.
    """
    out: Dict[int, Tuple[str, int]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        base = f"{_TASKS}/{tid}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != WORKER_THREAD:
                    continue
            with open(f"{base}/stat") as f:
                # the state letter follows the parenthesised name, which may hold spaces
                state = f.read().rsplit(")", 1)[1].split()[0]
            switches = 0
            with open(f"{base}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches",
                                        "nonvoluntary_ctxt_switches")):
                        switches += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended while we read it
        out[int(tid)] = (state, switches)
    return out


def drain(timeout: float = 2.0, interval: float = 0.002, quiet_rounds: int = 2) -> bool:
    """Wait, the GIL released, until every gloo worker thread is parked.

    A worker is parked when it is not runnable and its context-switch count did not
    move over ``quiet_rounds`` consecutive sleeps of ``interval`` seconds.  The sleeps
    release the GIL, so a worker that needs it for a last Python decref gets it and
    moves (runnable or switching), which this sees.  A worker blocked in a collective
    that will not finish (a peer is gone) counts as parked: waiting cannot help it.

    Args:
        timeout: the most seconds to wait.
        interval: seconds between two looks.
        quiet_rounds: consecutive still looks needed.
    Returns:
        True when the workers were parked (or there are none), False at the timeout.
    Raises:
        ValueError: a non-positive timeout or interval, or quiet_rounds < 1.
    """
    if not (timeout > 0 and interval > 0) or quiet_rounds < 1:
        raise ValueError(f"drain: timeout={timeout}, interval={interval} must be > 0 and "
                         f"quiet_rounds={quiet_rounds} >= 1")
    deadline = time.monotonic() + timeout
    last = gloo_workers()
    still = 0
    while last:
        time.sleep(interval)
        now = gloo_workers()
        moved = any(state == "R" or last.get(tid, (None, -1))[1] != sw
                    for tid, (state, sw) in now.items())
        still = 0 if moved else still + 1
        last = now
        if still >= quiet_rounds:
            break
        if time.monotonic() > deadline:
            logger.warning("gloo worker threads still busy %.1f s after the program's end; "
                           "exiting anyway (it may abort: tagc/teardown.py)", timeout)
            return False
    return True


def install() -> None:
    """Run :func:`drain` when the interpreter exits (once per process, idempotent).

    ``atexit`` handlers run before CPython starts finalizing, while a foreign thread
    may still take the GIL; that is the window :func:`drain` needs.
    """
    global _installed
    if not _installed:
        atexit.register(drain)
        _installed = True
